"""Megatron-Core trainer (DESIGN section 7). Import-light: nothing heavy is imported here.

Modules:
- ``worker.TrainerWorker(trainer_cfg, algo_cfg, hf_model_dir, total_steps)``: one torchrun rank; verbs
  ``compute_logprobs(batch)``, ``train_step(batch) -> metrics``, ``export_hf_state_dict()``,
  ``save_checkpoint(dir)``, ``load_checkpoint(dir)``, ``close()``.
- ``cpu_compat``: the only module that patches Megatron/torch.cuda (device ``cpu`` only, reversible).
- ``model``: HF config -> ``TransformerConfig`` + GPTModel (TE or local spec); ``norm``: SP-capable RMSNorm.
- ``megatron_args``: the trainer section -> Megatron's TransformerConfig / OptimizerConfig / DDP config /
  OptimizerParamScheduler arguments, ``trainer.megatron`` applied and its names checked.
- ``memory``: the per-rank memory estimate (pure Python, for the dry run); ``perf``: peak memory, model
  FLOPs and GPU peak rates behind ``perf/trainer_*``.
- ``parallel``: torch.distributed + Megatron ``parallel_state`` from ``TrainerConfig``.
- ``hf_weights``: load HF safetensors into a model chunk; gather it back as HF tensors on rank 0.
- ``logprobs``: vocab-parallel token log-probs and entropy.
- ``service``: the torchrun entry point of the trainer job: its ranks, the command service, the versioned worker.
"""
