"""Drives ditstream's gRPC API with grpcio (Google's Python gRPC), through stubs that
grpc_tools.protoc generated from proto/ditstream/v1/video.proto, as any gRPC client would. Run by
tests/e2e_grpc.rs with the server address, the stubs' folder and an output folder; prints a JSON
report last, and exits non-zero (with the reason) if anything differs from what video.proto
documents."""

import json
import sys
import threading

import grpc

address, stubs, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, stubs)
from ditstream.v1 import video_pb2 as pb  # noqa: E402
from ditstream.v1 import video_pb2_grpc  # noqa: E402

channel = grpc.insecure_channel(address)
stub = video_pb2_grpc.VideoServiceStub(channel)


def failure(call):
    """The status a call ends with (it must end with one)."""
    try:
        for _ in call():
            pass
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the call succeeded")


# A video: Accepted, Progress, the init segment, media segments, Completed, in that order; the
# segments concatenated are the MP4.
kinds, frames = [], 0
with open(f"{out}/grpcio.mp4", "wb") as f:
    for event in stub.Generate(pb.GenerateRequest(prompt="a red fox", num_frames=9, seed=3)):
        kind = event.WhichOneof("event")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
        if kind == "accepted":
            accepted = event.accepted
        elif kind == "init_segment":
            assert event.init_segment.mime_type.startswith("video/mp4"), event.init_segment
            f.write(event.init_segment.data)
        elif kind == "media_segment":
            assert event.media_segment.first_frame == frames, event.media_segment
            frames += event.media_segment.frame_count
            f.write(event.media_segment.data)
        elif kind == "completed":
            completed = event.completed
assert kinds[0] == "accepted" and kinds[-1] == "completed", kinds
assert kinds.index("init_segment") < kinds.index("media_segment"), kinds
assert accepted.request_id.startswith("req-") and accepted.num_frames == 9, accepted
assert completed.frames == 9 == frames and completed.timings.total_ms > 0, completed

# A request that breaks a limit: INVALID_ARGUMENT naming the field, the value and the rule.
code, details = failure(lambda: stub.Generate(pb.GenerateRequest(prompt="x", width=7)))
assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
assert details.startswith("width = 7: must be a positive multiple of 16"), details

# A 100 kB model name: still INVALID_ARGUMENT, whose message fits grpcio's metadata limit.
code, details = failure(lambda: stub.Generate(pb.GenerateRequest(prompt="x", model="m" * 100_000)))
assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
assert details.endswith("(100000 bytes): unknown; this server runs \"tiny\""), details

# A deadline that passes while the request runs: DEADLINE_EXCEEDED.
code, details = failure(
    lambda: stub.Generate(pb.GenerateRequest(prompt="slow", num_frames=81, steps=100), timeout=1.0)
)
assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)

# Cancel: of a running request, whose stream then ends CANCELLED; of an unknown one, NOT_FOUND.
running = stub.Generate(pb.GenerateRequest(prompt="cancelled", num_frames=81, steps=100))
first = next(running)
assert first.WhichOneof("event") == "accepted", first
ended = {}


def drain():
    try:
        for _ in running:
            pass
    except grpc.RpcError as e:
        ended["code"] = e.code()


reader = threading.Thread(target=drain)
reader.start()
assert stub.Cancel(pb.CancelRequest(request_id=first.accepted.request_id)).cancelled
reader.join(timeout=30)
assert ended.get("code") == grpc.StatusCode.CANCELLED, ended
try:
    stub.Cancel(pb.CancelRequest(request_id="req-00000000000000000000000000000000"))
    raise AssertionError("an unknown request was cancelled")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.NOT_FOUND, e

health = stub.Health(pb.HealthRequest())
assert health.serving, health
models = [m.name for m in stub.ListModels(pb.ListModelsRequest()).models]
assert models == ["tiny"], models

print(json.dumps({"request_id": accepted.request_id, "frames": frames, "events": kinds}))
