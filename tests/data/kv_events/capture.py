"""Capture a vLLM server's KV event messages (raw frames) while filling its pool past capacity.

Run with the vLLM venv's Python (it has zmq and msgspec; see README.md in this folder):

    python capture.py BASE_URL ZMQ_ENDPOINT OUT.msgpack MODEL RNG_SEED NUM_PROMPTS

Distinct prompts of about 1,700 tokens share a 300-token prefix; after them the prefix cache is
reset (POST /reset_prefix_cache, vLLM's dev mode) and the prefix sent once more.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import urllib.request

import msgspec
import zmq


def post(url: str, body: object) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=900) as response:
        return response.read()


def main() -> None:
    base, endpoint, out, model, rng_seed, num_prompts = sys.argv[1:7]
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    time.sleep(1.0)  # let the subscription reach the publisher
    messages: list[list[bytes]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if subscriber.poll(200):
                messages.append(subscriber.recv_multipart())

    reader = threading.Thread(target=read)
    reader.start()
    rng = random.Random(int(rng_seed))
    prefix = [rng.randrange(100, 40000) for _ in range(300)]
    for _ in range(int(num_prompts)):
        prompt = prefix + [rng.randrange(100, 40000) for _ in range(1400)]
        post(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    post(base + "/reset_prefix_cache", None)
    post(base + "/v1/completions", {"model": model, "prompt": prefix, "max_tokens": 2, "temperature": 0})
    time.sleep(2.0)
    stop.set()
    reader.join()
    with open(out, "wb") as file:
        file.write(msgspec.msgpack.encode([[bytes(frame) for frame in message] for message in messages]))
    print(len(messages), "messages")


if __name__ == "__main__":
    main()
