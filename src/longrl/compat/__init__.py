"""Other tools' faces over longrl: TRL's GRPOConfig/GRPOTrainer/SFTConfig/SFTTrainer (trl.py) and Unsloth's
FastLanguageModel (unsloth.py). Thin layers over the recipes and the config; nothing below them imports them."""
