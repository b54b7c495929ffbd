"""SGLang rollout instances: launch flags, process start + health wait, the runtime adapter and the
trainer-side distributed weight push.

Nothing here imports sglang: instances are separate processes (``python -m sglang.launch_server``,
possibly from another interpreter, since SGLang pins its own torch), spoken to over HTTP.
"""
