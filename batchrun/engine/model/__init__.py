"""What the engine knows of a model: its load probe and plan, its loading and quantization, the memory it
needs, its stateful layers and images, and how it is prepared: the families' adapters (families/), the
rewrites that make its layers fast (ops/) and its LoRA adapters (lora/)."""
