"""Broadcast latency: the shared-memory MessageQueue vs a ZMQ PUB/SUB of the same SchedulerOutputs.

One writer (the executor), N reader processes (the workers). Each iteration broadcasts one
encoded ExecuteModelCall and waits for every reader's 8-byte acknowledgement, which comes back
over the same kind of channel (a MessageQueue per reader, or a ZMQ PUSH into one PULL), so
the figure is a round trip: what an executor step pays for transport. Prints the median and
p90 per round trip for a decode step (64 running requests) and a prefill step (a 2k-token
prompt), and the ZMQ / MessageQueue ratio.

    PYTHONPATH=$PWD python benchmarks/message_queue_latency.py [--readers 2] [--iters 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from typing import Any

import zmq

from lm_console.engine.distributed.message_queue import Handle, MessageQueue
from lm_console.engine.sampling_params import SamplingParams
from lm_console.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lm_console.engine.worker.rpc_protocol import ExecuteModelCall, WorkerCodec


def decode_step(num_reqs: int = 64) -> SchedulerOutput:
    ids = [f"req-{i}" for i in range(num_reqs)]
    return SchedulerOutput(
        scheduled_new_reqs=[], num_scheduled_tokens={i: 1 for i in ids}, total_num_scheduled_tokens=num_reqs,
        scheduled_cached_reqs=CachedRequestData(ids, [None] * num_reqs, [100 + i for i in range(num_reqs)]),
        finished_req_ids=set(), preempted_req_ids=set())


def prefill_step(num_tokens: int = 2048) -> SchedulerOutput:
    new = NewRequestData("req-new", list(range(num_tokens)), [], SamplingParams(temperature=0.0),
                         (list(range(1, num_tokens // 16 + 1)),), 0, [])
    return SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"req-new": num_tokens}, total_num_scheduled_tokens=num_tokens,
        finished_req_ids=set(), preempted_req_ids=set())


def _shm_reader(handle: Handle, rank: int, conn: Any, count: int) -> None:
    queue = MessageQueue.create_reader(handle, rank)
    reply = MessageQueue(1, 4, 4096)
    conn.send(reply.export_handle())
    reply.wait_until_ready(60)
    for _ in range(count):
        queue.dequeue()
        reply.enqueue([b"ack-ack!"])
    conn.recv()  # the parent has read the last ack
    queue.close()
    reply.close()


def _zmq_reader(sub_address: str, push_address: str, count: int) -> None:
    context = zmq.Context()
    sub, push = context.socket(zmq.SUB), context.socket(zmq.PUSH)
    sub.connect(sub_address)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    push.connect(push_address)
    push.send(b"ready")
    for _ in range(count):
        sub.recv_multipart()
        push.send(b"ack-ack!")
    push.close(linger=1000)
    sub.close(linger=0)
    context.term()


def bench_shm(frames: list[bytes], num_readers: int, iters: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    queue = MessageQueue(num_readers, 8, 1 << 20)
    pipes, procs, replies = [], [], []
    for rank in range(num_readers):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_shm_reader, args=(queue.export_handle(), rank, child, iters))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    queue.wait_until_ready(60)
    for parent in pipes:
        replies.append(MessageQueue.create_reader(parent.recv(), 0))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        queue.enqueue(frames)
        for reply in replies:
            reply.dequeue()
        times.append(time.perf_counter() - start)
    for parent, proc, reply in zip(pipes, procs, replies):
        parent.send(b"done")
        proc.join(30)
        reply.close()
    queue.close()
    return times


def bench_zmq(frames: list[bytes], num_readers: int, iters: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    context = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="lmc-mqbench-")
    pub, pull = context.socket(zmq.XPUB), context.socket(zmq.PULL)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.bind(f"ipc://{tmp}/pub")
    pull.bind(f"ipc://{tmp}/pull")
    procs = [ctx.Process(target=_zmq_reader, args=(f"ipc://{tmp}/pub", f"ipc://{tmp}/pull", iters))
             for _ in range(num_readers)]
    for proc in procs:
        proc.start()
    for _ in range(num_readers):
        pub.recv()  # a subscription: no message is lost to the slow-joiner problem
        pull.recv()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        pub.send_multipart(frames)
        for _ in range(num_readers):
            pull.recv()
        times.append(time.perf_counter() - start)
    for proc in procs:
        proc.join(30)
    pub.close(linger=0)
    pull.close(linger=0)
    context.term()
    return times


def _us(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=10)[int(q * 10) - 1] * 1e6 if q < 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    codec = WorkerCodec()
    for name, step in (("decode (64 reqs)", decode_step()), ("prefill (2048 tok)", prefill_step())):
        frames = [bytes(f) for f in codec.encode(ExecuteModelCall(1, step))]
        size = sum(len(f) for f in frames)
        shm = bench_shm(frames, args.readers, args.iters)
        zq = bench_zmq(frames, args.readers, args.iters)
        shm_med, zmq_med = statistics.median(shm) * 1e6, statistics.median(zq) * 1e6
        print(f"{name:20s} {size:6d} B  MessageQueue median {shm_med:7.1f} us p90 {_us(shm, 0.9):7.1f} us | "
              f"ZMQ PUB/SUB median {zmq_med:7.1f} us p90 {_us(zq, 0.9):7.1f} us | ZMQ/MQ = {zmq_med / shm_med:.2f}x")


if __name__ == "__main__":
    main()
