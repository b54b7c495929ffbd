"""What a run wrote to TensorBoard, read back with TensorBoard's own event reader: the scalars and
the custom-scalars layout the tests check."""

from __future__ import annotations

from pathlib import Path


def read_scalar_tags(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All scalars in ``logdir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}


def read_layout(logdir: str | Path) -> dict[str, dict[str, list[str]]]:
    """The custom-scalars layout stored in ``logdir`` as the plugin reads it: category title ->
    chart title -> tag regexes (empty if none was written)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    if metadata.CONFIG_SUMMARY_TAG not in acc.Tags().get("tensors", []):
        return {}
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[-1].tensor_proto.string_val[0])
    return {c.title: {chart.title: list(chart.multiline.tag) for chart in c.chart} for c in layout.category}
