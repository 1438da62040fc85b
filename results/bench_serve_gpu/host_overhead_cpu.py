"""Host overhead of serving against the in-process batched loop, on the CPU: a tiny random model (decode steps of a
few milliseconds), 64 AutoAct-shaped episodes on 16 rows, greedy. Runs: in-process (BatchedExecutor), served by a
server in its own process (streamed, not streamed), served by a server in this process (as bench serve starts its
own). Run from the repository root: python results/bench_serve_gpu/host_overhead_cpu.py"""

import dataclasses
import multiprocessing as mp
import sys
import time

sys.path.insert(0, "tests")
import torch
from conftest import tiny_multi_lora
from test_serve_reliability import ByteTokenizer

from eval_suite.evaluate.executors import EpisodeTask
from lragent.agents import AgentConfig, AgentLoop, get_spec

torch.set_num_threads(1)
N, ROWS = 64, 16


def tasks(scheme):
    out = []
    for i in range(N):
        spec = dataclasses.replace(get_spec("hotpotqa"), system_prompt=f"[{i}] Solve the task with tools.")
        loop = AgentLoop(
            None,
            spec,
            AgentConfig(max_steps=4, thought_tokens=24, action_type_tokens=3, argument_tokens=8, reflect_tokens=3),
        )
        ep = loop.episode(f"Q{i}: is {i} odd?", lambda a, b, i=i: f"obs {i} {a}")
        out.append(EpisodeTask(key=(scheme, 0, str(i)), scheme=scheme, seed=i, question=None, episode=ep))
    return out


def in_process(model):
    from eval_suite.evaluate.batched_executor import BatchedExecutor

    ex = BatchedExecutor(model, ByteTokenizer(), batch=ROWS, capacity=4096, eos_token_ids=[])
    t = time.perf_counter()
    n = sum(1 for _ in ex.run(tasks("base_lr_shared")))
    return n, time.perf_counter() - t


def served(model, interval=None):
    from eval_suite.evaluate.server_client import ServerExecutor
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    old = sys.getswitchinterval()
    if interval:
        sys.setswitchinterval(interval)
    tok = ByteTokenizer()
    sch = Scheduler(Engine(model, "base_lr_shared", rows=ROWS, capacity=4096, tokenizer=tok, eos_token_ids=[]), tok)
    server = ServerThread(build_app(ServerState(sch, "base_lr_shared", "tiny", tok))).start()
    try:
        ex = ServerExecutor(server.url, temperature=0.0, top_p=1.0, concurrency=ROWS, stream=True)
        t = time.perf_counter()
        n = sum(1 for _ in ex.run(tasks("base_lr_shared")))
        wall = time.perf_counter() - t
    finally:
        server.stop()
        sys.setswitchinterval(old)
    return n, wall, len(ex.completions)


def child(conn, stream_flag):
    import torch

    torch.set_num_threads(1)
    from eval_suite.serve.api_server import ServerThread, build_app
    from eval_suite.serve.server_state import ServerState
    from lragent.engine import Engine
    from lragent.serving.scheduler import Scheduler

    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    tok = ByteTokenizer()
    sch = Scheduler(Engine(model, "base_lr_shared", rows=ROWS, capacity=4096, tokenizer=tok, eos_token_ids=[]), tok)
    server = ServerThread(build_app(ServerState(sch, "base_lr_shared", "tiny", tok))).start()
    conn.send(server.url)
    conn.recv()
    server.stop()


def run(stream):
    from eval_suite.evaluate.server_client import ServerExecutor

    a, b = mp.Pipe()
    p = mp.get_context("spawn").Process(target=child, args=(b, stream))
    p.start()
    url = a.recv()
    ex = ServerExecutor(url, temperature=0.0, top_p=1.0, concurrency=ROWS, stream=stream)
    t = time.perf_counter()
    n = sum(1 for _ in ex.run(tasks("base_lr_shared")))
    wall = time.perf_counter() - t
    a.send("stop")
    p.join()
    return n, wall


if __name__ == "__main__":
    model = tiny_multi_lora("tiny-llama", b_std=0.3)
    print("in-process", in_process(model), flush=True)
    print("served in its own process, streamed", run(True), flush=True)
    print("served in its own process, not streamed", run(False), flush=True)
    print("in-process again", in_process(model), flush=True)
    print("served in this process, streamed", end=" ")

    print(served(model), flush=True)
    print("in-process third", in_process(model), flush=True)
