"""Stands in for the `sgl_kernel` module of the CUDA-only `sglang-kernel` wheel (SGLang CPU venv only).

`sglang-kernel` 0.4.10 ships CUDA binaries only and no source distribution, yet SGLang 0.5.23 imports
names from `sgl_kernel` at module load on its CPU path (e.g. `sglang/kernels/ops/kvcache/cache_move.py`:
`from sgl_kernel import copy_all_layer_kv_cache_cpu`). On a CPU without AMX SGLang takes its plain
torch paths for a plain decoder (Qwen3, Qwen3-MoE) and never calls them; every name here raises
NotImplementedError, so a call would show instead of computing something wrong. Installed by
tools/setup_sglang_cpu.sh. Left out: ``sgl_kernel.mamba`` (imported only by linear-attention models).
"""


def _not_on_cpu(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is a stand-in in the SGLang CPU venv (tools/sglang_cpu/sgl_kernel): "
            "the CUDA-only sglang-kernel wheel is not installed"
        )

    missing.__name__ = name
    return missing


#: the names SGLang 0.5.23 imports from ``sgl_kernel`` at module level when ``is_cpu()`` (file: names)
_IMPORTED_ON_CPU = (
    "assign_req_to_token_pool_cpu",  # srt/mem_cache/allocation.py
    "copy_all_layer_kv_cache_cpu",  # kernels/ops/kvcache/cache_move.py
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",  # kernels/ops/speculative/cache_locs.py
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu",  # kernels/ops/speculative/spec_tree.py
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",  # kernels/ops/speculative/eagle.py
    "rotate_input_ids_cpu",  # kernels/ops/speculative/multi_layer_eagle.py
)

for _name in _IMPORTED_ON_CPU:
    globals()[_name] = _not_on_cpu(_name)
del _name
