"""The allocator default (longrl/allocator.py): expandable segments unless the user configured the allocator."""

from longrl import allocator


def test_sets_expandable_segments_when_nothing_is_configured(monkeypatch):
    monkeypatch.setattr(allocator, "_torch_before_2_10", lambda: False)
    env = {}
    assert allocator.default_allocator_settings(env) == "PYTORCH_ALLOC_CONF"
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    monkeypatch.setattr(allocator, "_torch_before_2_10", lambda: True)  # older torch reads only the CUDA name
    env = {}
    assert allocator.default_allocator_settings(env) == "PYTORCH_CUDA_ALLOC_CONF"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_a_users_setting_wins_and_can_opt_out():
    for name in allocator.ALLOCATOR_VARIABLES:
        env = {name: "max_split_size_mb:128"}
        assert allocator.default_allocator_settings(env) is None
        assert env == {name: "max_split_size_mb:128"}
    env = {"LONGRL_DEFAULT_ALLOCATOR": "0"}
    assert allocator.default_allocator_settings(env) is None
    assert env == {"LONGRL_DEFAULT_ALLOCATOR": "0"}


def test_importing_longrl_sets_it_in_a_fresh_process():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in allocator.ALLOCATOR_VARIABLES}
    out = subprocess.run([sys.executable, "-c", "import os, longrl; print(os.environ.get('PYTORCH_ALLOC_CONF'), "
                          "os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert "expandable_segments:True" in out
