"""packer: offline sequence packing for LLM fine-tuning."""
__version__ = "0.1.0"
