"""Agentic GRPO: environments, tools, tool-call parsing, token-exact trajectories, a code sandbox."""
