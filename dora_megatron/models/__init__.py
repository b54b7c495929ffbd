"""Model presets, Hugging Face model directories (``hf_model_dir``), config.json, and the supervised
warm start of a preset model (``warm_start``)."""
