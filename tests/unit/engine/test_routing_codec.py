"""routed_experts wire codec (SGLang's int32 base64) and the EPLB physical -> logical map."""

import base64

import numpy as np
import pytest

from dora_megatron.comm.routed_experts import (
    NO_EXPERT,
    decode_routed_experts,
    encode_routed_experts,
    physical_to_logical,
    physical_to_logical_map,
)


def test_codec_matches_numpy_int32_bytes():
    arr = np.array([[[3, 0], [1, NO_EXPERT]], [[2, 7], [6, 5]], [[0, 1], [4, 2]]], dtype=np.int32)
    text = encode_routed_experts(arr.reshape(-1).tolist())
    assert text == base64.b64encode(arr.astype("<i4").tobytes()).decode()
    assert decode_routed_experts(text, num_layers=2, top_k=2) == arr.tolist()
    with pytest.raises(ValueError, match="multiple of 4"):
        decode_routed_experts(text, num_layers=5, top_k=2)


def test_eplb_redundant_replicas_map_back_to_logical_experts():
    # 4 logical experts on 6 physical slots (2 GPUs x 3 slots): experts 0 and 2 are replicated,
    # and layer 1 has a different placement (EPLB rebalances per layer)
    layer0 = [0, 1, 2, 3, 0, 2]
    layer1 = [3, 2, 1, 0, 1, 1]
    table = [layer0, layer1]
    # token routed (layer 0) to slots 4 and 1 = logical 0 (replica) and 1; layer 1 slots 5, 0 = logical 1, 3
    routed = [[[4, 1], [5, 0]], [[0, 5], [2, NO_EXPERT]]]
    assert physical_to_logical(routed, table) == [[[0, 1], [1, 3]], [[0, 2], [1, NO_EXPERT]]]
    # both replicas of a logical expert give the same logical id
    assert physical_to_logical([[[0, 4], [4, 5]]], table) == [[[0, 0], [1, 1]]]
    with pytest.raises(ValueError, match="layer 1: physical slot 6"):
        physical_to_logical([[[0, 1], [6, 0]]], table)
    assert physical_to_logical_map(layer0, 2) == [layer0, layer0]
