"""Reading users' record files (JSON lines, Parquet, hub) with each row's line number; chat conversations
and RL prompts built from them."""
