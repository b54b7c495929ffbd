"""Megatron-Core trainer (DESIGN section 7). Import-light: nothing heavy is imported here.

Modules:
- ``worker.TrainerWorker(trainer_cfg, algo_cfg, hf_model_dir)``: one torchrun rank; verbs
  ``compute_logprobs(batch)``, ``train_step(batch) -> metrics``, ``export_hf_state_dict()``,
  ``save_checkpoint(dir)``, ``load_checkpoint(dir)``, ``close()``.
- ``cpu_compat``: the only module that patches Megatron/torch.cuda (device ``cpu`` only, reversible).
- ``model``: HF config -> ``TransformerConfig`` + GPTModel (TE or local spec); ``norm``: SP-capable RMSNorm.
- ``parallel``: torch.distributed + Megatron ``parallel_state`` from ``TrainerConfig``.
- ``hf_weights``: load HF safetensors into a model chunk; gather it back as HF tensors on rank 0.
- ``logprobs``: vocab-parallel token log-probs and entropy.
- ``parity`` / ``scenarios``: logits vs transformers and small rank programs used by tests and tools.
- ``entry`` / ``service``: the runtime's torchrun entry point and command service.
"""
