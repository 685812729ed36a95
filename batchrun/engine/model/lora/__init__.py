"""LoRA adapters: their configs, their weights checked against the model, and the layers that apply them."""
