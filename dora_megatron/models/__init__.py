"""Model presets and Hugging Face directory I/O."""
