"""The sparrow.v1 stubs: committed output of scripts/gen_protos.py (never stale), importable under
the services package, and usable over a real gRPC channel on loopback."""

import importlib.util
import sys
from concurrent import futures
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[3]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_not_stale(tmp_path):
    _load_generator().generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "sparrow").rglob("*") if p.is_file()}
    committed_root = REPO / "services" / "api"
    committed = {
        p.relative_to(committed_root): p.read_bytes()
        for p in (committed_root / "sparrow").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert set(fresh) == set(committed), "run: python scripts/gen_protos.py"
    stale = [str(name) for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run python scripts/gen_protos.py"


def test_trajectories_stream_and_are_acked_over_loopback():
    from services.api.sparrow.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

    class Trainer(rollout_pb2_grpc.RolloutServiceServicer):
        def StreamTrajectories(self, request_iterator, context):
            for request in request_iterator:
                if request.WhichOneof("item") == "hello":
                    yield rollout_pb2.StreamTrajectoriesResponse(
                        hello=rollout_pb2.TrainerHello(latest=common_pb2.Versions(policy_version=7))
                    )
                else:
                    t = request.trajectory
                    ok = len(t.token_ids) == len(t.logprobs) == len(t.top_logprobs)
                    yield rollout_pb2.StreamTrajectoriesResponse(
                        ack=rollout_pb2.TrajectoryAck(
                            trajectory_id=t.trajectory_id,
                            status=rollout_pb2.ACK_STATUS_ACCEPTED if ok else rollout_pb2.ACK_STATUS_REJECTED,
                            reason="" if ok else "token/logprob length mismatch",
                        )
                    )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(Trainer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        top = rollout_pb2.TopLogprobs(token_ids=[5, 6], logprobs=[-0.1, -2.5])
        good = rollout_pb2.Trajectory(trajectory_id="g", token_ids=[5], logprobs=[-0.1], top_logprobs=[top])
        bad = rollout_pb2.Trajectory(trajectory_id="b", token_ids=[5, 6], logprobs=[-0.1], top_logprobs=[top])
        requests = [
            rollout_pb2.StreamTrajectoriesRequest(hello=rollout_pb2.GeneratorHello(generator_id="gen-0")),
            rollout_pb2.StreamTrajectoriesRequest(trajectory=good),
            rollout_pb2.StreamTrajectoriesRequest(trajectory=bad),
        ]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            replies = list(rollout_pb2_grpc.RolloutServiceStub(channel).StreamTrajectories(iter(requests), timeout=30))
        assert replies[0].hello.latest.policy_version == 7
        assert [(r.ack.trajectory_id, r.ack.status) for r in replies[1:]] == [
            ("g", rollout_pb2.ACK_STATUS_ACCEPTED),
            ("b", rollout_pb2.ACK_STATUS_REJECTED),
        ]
        assert replies[2].ack.reason == "token/logprob length mismatch"
    finally:
        server.stop(grace=1).wait()
