"""qshard: fine-tune large language models with PyTorch FSDP2 and QLoRA."""

__version__ = "0.1.0"
