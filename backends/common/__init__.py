"""What both built-in backends use: CPU features (ISA levels), thread binding, and memory helpers."""
