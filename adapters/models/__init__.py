"""transformers and peft models: loading and building causal LMs (tiny ones for tests included),
hybrid and vision-language models, LoRA, chat templates, FSDP2 sharding.
"""
