"""The training sample, one record from the controller's released batch to the trainer rank, and
the ``/train`` body that carries it.

WHY one record: the controller builds a sample from the engine's answer, the ``/train`` body (JSON)
or a batch directory (:mod:`.batch_files`, columnar files) carries it, and every trainer rank reads
it. With a dict per sample its schema was restated by the service's checks, the batch files'
columns and the worker's string lookups; here the fields are named once, and each path fills the
same dataclass: the controller with its own compact arrays (``array('i')``/``array('f')``), the
batch reader with numpy views of the mapped files, the service with the lists of a JSON body
(decoded by msgspec against the field types below, then :meth:`TrainSample.check`). A batch
directory's entry in the ``/train`` body (:class:`BatchEntry`: the directory and a few numbers per
sample) is decoded by msgspec the same way, so a rank reads the files from typed fields.

The token columns hold a list (a JSON body), an ``array.array`` (the controller) or a numpy array
(a batch directory): what the worker takes is any flat sequence of numbers, never a per-token
Python object it has to build.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Mapping, Sequence

import msgspec
import numpy as np
from msgspec import Meta

from dora_megatron.comm.protocol import field_message
from dora_megatron.comm.routed_spool import ROUTED_DTYPES, SEGMENT_NAME

if TYPE_CHECKING:  # the arrays the controller and the batch reader fill the columns with
    from array import array

    IntColumn = Sequence[int] | array[int] | np.ndarray[Any, Any]
    FloatColumn = Sequence[float] | array[float] | np.ndarray[Any, Any]
else:  # what msgspec decodes a JSON body's columns into (lists, checked element by element)
    IntColumn = Sequence[int]
    FloatColumn = Sequence[float]


class SampleError(ValueError):
    """A training sample that cannot be trained on; the message names the sample and the field."""


@dataclass
class TrainSample:
    """One sample of a training step. ``advantage`` (precomputed) or ``reward`` with ``group_id``
    (the trainer's group-relative advantage) must be given; ``version``: the weights that produced
    it (the on-policy metrics; a batch directory may leave it out)."""

    prompt_ids: IntColumn
    response_ids: IntColumn
    #: one per response token: the engine's log-probs (None only for ``compute_logprobs``)
    rollout_logprobs: FloatColumn | None = None
    version: int | None = None
    reward: float | None = None
    group_id: Any = None  # hashable: the samples of one group share it
    advantage: float | None = None
    loss_mask: IntColumn | None = None  # a workflow's trajectory: 1 on model tokens, 0 on the tools'
    #: the engine's routed experts for prompt + response (routing replay): a flat compact integer
    #: array (the controller, a batch directory) or SGLang's base64 text (a JSON body)
    routed_experts: Any = None

    def check(self, where: str) -> "TrainSample":
        """What training needs beyond the field types; ``where`` (``samples[3]``) prefixes the error."""
        for name in ("rollout_logprobs", "version"):
            if getattr(self, name) is None:
                raise SampleError(f"{where}.{name} is missing")
        if self.advantage is None and (self.reward is None or self.group_id is None):
            raise SampleError(f"{where} needs a numeric 'advantage', or 'reward' with 'group_id'")
        if len(self.rollout_logprobs or ()) != len(self.response_ids):
            raise SampleError(f"{where}: rollout_logprobs ({len(self.rollout_logprobs or ())}) and response_ids "
                              f"({len(self.response_ids)}) differ in length")
        if not len(self.response_ids):
            raise SampleError(f"{where}.response_ids is empty")
        mask = self.loss_mask
        if mask is not None:
            if len(mask) != len(self.response_ids):
                raise SampleError(f"{where}.loss_mask must be a list of one 0/1 per response token")
            bad = next((m for m in mask if m not in (0, 1)), None)
            if bad is not None:
                raise SampleError(f"{where}.loss_mask holds {bad!r}; only 0 (environment) and 1 (model)")
            if not any(mask):
                raise SampleError(f"{where}.loss_mask is all 0 (no model token to train on)")
        return self

    def tokens(self) -> int:
        """Prompt + response tokens (what the trainer plans a step by)."""
        return len(self.prompt_ids) + len(self.response_ids)


#: a spooled sample's ``routed_at``: [segment file of the spool, byte offset, dtype of the ids]
#: (:meth:`~dora_megatron.comm.routed_spool.SpooledRouted.entry`); the file name is a bare
#: ``routed_NNNNNN.bin`` (never a path out of the spool), the dtype one the spool writes
RoutedAt = tuple[Annotated[str, Meta(pattern=rf"\A{SEGMENT_NAME.pattern}\Z")], Annotated[int, Meta(ge=0)],
                 Annotated[str, Meta(pattern=rf"\A({'|'.join(ROUTED_DTYPES)})\Z")]]
Count = Annotated[int, Meta(ge=0)]


class BatchSample(msgspec.Struct, gc=False):
    """One sample of a batch directory's entry: its lengths (where its rows lie in the files, what
    the trainer plans by) and the scalar fields of its :class:`TrainSample`. ``routed_ids``: how
    many routed-expert ids it has (in ``routed_experts.npy``, or in the spool at ``routed_at``);
    ``loss_mask``: whether its rows of ``loss_mask.npy`` are its own (None: the batch has no mask).

    WHY a msgspec struct: an untrusted entry is checked by its field types in one pass (a bool or a
    negative length is refused, naming ``batch.samples[3].prompt_tokens``) and a step of 8,192
    samples decodes in a few ms; ``gc=False``: its fields hold no container that could form a cycle."""

    prompt_tokens: Count
    response_tokens: Count
    routed_ids: Count | None = None
    routed_at: RoutedAt | None = None
    reward: float | None = None
    group_id: str | int | None = None  # the samples of one group share it
    version: int | None = None
    advantage: float | None = None
    loss_mask: bool | None = None

    def __post_init__(self) -> None:
        """What the types cannot say (msgspec reports a ValueError here at the sample's path)."""
        if self.response_tokens == 0:
            raise ValueError("response_tokens is 0 (no token to train on)")
        if self.advantage is None and (self.reward is None or self.group_id is None):
            raise ValueError("needs a numeric 'advantage', or 'reward' with 'group_id'")
        if self.routed_at is not None and self.routed_ids is None:
            raise ValueError("routed_at needs routed_ids (how many ids to read there)")


class BatchEntry(msgspec.Struct):
    """The ``batch`` of a ``/train`` body: the batch directory
    (:func:`~dora_megatron.comm.batch_files.write_batch`) and each sample's entry, in file order;
    :class:`~dora_megatron.comm.batch_files.BatchReader` opens it."""

    dir: Annotated[str, Meta(min_length=1)]
    samples: Annotated[list[BatchSample], Meta(min_length=1)]

    def __post_init__(self) -> None:
        """Routed experts come with every sample or none (one ``routed_experts.npy`` layout)."""
        routed = [s.routed_ids is not None for s in self.samples]
        if any(routed) and not all(routed):
            raise ValueError(f"samples[{routed.index(False)}] has no routed_ids and samples[{routed.index(True)}] "
                             "has: every sample carries them or none does")

    def lengths(self) -> list[int]:
        """Each sample's prompt + response tokens (what the trainer plans a step by)."""
        return [s.prompt_tokens + s.response_tokens for s in self.samples]


@dataclass
class TrainRequest:
    """``POST /train``: the step, and its samples in the body (``samples``) or in a batch directory
    (``batch``: :func:`~dora_megatron.comm.batch_files.write_batch`'s entry, typed; its files are
    checked by :class:`~dora_megatron.comm.batch_files.BatchReader`). What every trainer rank
    executes a step from (pickled to the ranks after rank 0)."""

    step: int
    samples: list[TrainSample] | None = None
    batch: BatchEntry | None = None


def _wire(obj: Any) -> Any:
    """A column's JSON form: arrays as lists (msgspec encodes lists and numbers itself)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise NotImplementedError(f"{type(obj).__name__} has no JSON form")


_ENCODER = msgspec.json.Encoder(enc_hook=_wire)


def routed_text(routed: Any) -> str | None:
    """A sample's routed experts in SGLang's encoding (base64 of little-endian int32): what the
    journal, the checkpoint and a ``/train`` body carry."""
    if routed is None or isinstance(routed, str):
        return routed
    return base64.b64encode(np.asarray(routed).astype("<i4").tobytes()).decode("ascii")


def encode_train(step: int, samples: Sequence[TrainSample]) -> bytes:
    """A ``/train`` body with the samples in it: arrays as lists, routed experts as SGLang's text, a
    null field left out (the decoder's default). Blocking (proportional to the tokens): call it in
    a worker thread."""
    def fields(s: TrainSample) -> dict[str, Any]:
        out = {k: v for k, v in vars(s).items() if v is not None}
        if s.routed_experts is not None:
            out["routed_experts"] = routed_text(s.routed_experts)
        return out

    return _ENCODER.encode({"step": step, "samples": [fields(s) for s in samples]})


def decode_train(body: Mapping[str, Any]) -> TrainRequest:
    """A ``/train`` body (parsed JSON) as a :class:`TrainRequest`: the field types (the step, each
    sample's columns, or the batch entry's fields) checked by msgspec in one pass over the body,
    each sample's rules by :meth:`TrainSample.check` (or :class:`BatchSample`'s); a
    :class:`SampleError` names what is wrong (``samples[3].reward must be a number, got 'x'``,
    ``batch.samples[3].prompt_tokens must be >= 0, got -1``)."""
    try:
        request = msgspec.convert(body, TrainRequest, strict=True)
    except msgspec.ValidationError as err:
        raise SampleError(field_message(err, body, what="/train")) from None
    if request.batch is not None:  # the samples are in a batch directory (BatchReader checks its files)
        return TrainRequest(request.step, batch=request.batch)
    if not request.samples:
        raise SampleError("'samples' must be a non-empty list")
    for i, sample in enumerate(request.samples):
        sample.check(f"samples[{i}]")
    return request
