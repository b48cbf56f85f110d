"""lm_console/engine/ipc.py: addresses and the msgpack codec with out-of-band tensor frames."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import torch

from lm_console.engine.ipc import MsgpackDecoder, MsgpackEncoder, make_engine_addresses
from lm_console.engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from lm_console.engine.request import MultiModalFeatureSpec
from lm_console.engine.sampling_params import SamplingParams


def test_tensors_travel_as_extra_frames() -> None:
    image = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    embeds = torch.randn(3, 5).to(torch.bfloat16)
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=3),
        eos_token_id=2, arrival_time=1.0,
        mm_features=[MultiModalFeatureSpec("img0", 1, 2, data={"pixel_values": image, "embeds": embeds})])
    frames = MsgpackEncoder().encode(request)
    assert len(frames) == 3 and image.tobytes() not in frames[0]  # buffers ride outside the payload
    assert bytes(frames[1]) == image.tobytes()
    decoded = MsgpackDecoder(EngineCoreRequest).decode([bytes(f) for f in frames])
    data = decoded.mm_features[0].data
    assert np.array_equal(data["pixel_values"], image) and data["pixel_values"].dtype == np.float32
    assert data["embeds"].dtype == torch.bfloat16 and torch.equal(data["embeds"], embeds)
    assert decoded.sampling_params.max_tokens == 3 and decoded.mm_features[0].identifier == "img0"
    with pytest.raises(ValueError, match="missing"):
        MsgpackDecoder(EngineCoreRequest).decode(frames[:1])


def test_decoding_keeps_the_stop_token_ids_the_frontend_added() -> None:
    params = SamplingParams(stop_token_ids=[7])
    params.all_stop_token_ids |= {2, 9}  # EOS ids added by the InputProcessor
    request = EngineCoreRequest("r", [1], params, 2, 0.0)
    decoded = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert decoded.sampling_params.all_stop_token_ids == {2, 7, 9}


def test_outputs_roundtrip() -> None:
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH)])
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert decoded.outputs == outputs.outputs and decoded.outputs[0].finished


def test_addresses() -> None:
    ipc = make_engine_addresses("ipc", kv_events=True)
    assert stat.S_IMODE(os.stat(ipc.ipc_dir).st_mode) == 0o700
    assert ipc.input_address.startswith(f"ipc://{ipc.ipc_dir}/")
    assert ipc.kv_events_endpoint.startswith(f"ipc://{ipc.ipc_dir}/")
    directory = ipc.ipc_dir
    ipc.cleanup()
    assert not os.path.exists(directory)
    tcp = make_engine_addresses("tcp")
    assert tcp.input_address.startswith("tcp://127.0.0.1:") and tcp.kv_events_endpoint is None
    with pytest.raises(ValueError, match="transport"):
        make_engine_addresses("udp")
