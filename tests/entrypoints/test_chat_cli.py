"""`keel chat`: streams answers, keeps the conversation, exits cleanly on EOF and on Ctrl-C;
and `keel serve` reads its API key from KEEL_API_KEY."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import psutil

from keel import LLM, SamplingParams
from tests.entrypoints.openai.conftest import free_port


def _chat_cmd(model: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "keel.entrypoints.cli", "chat", model, "--dtype", "float32",
            "--temperature", "0", "--kv-cache-memory-gib", "0.25", *extra]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_chat_keeps_the_conversation_and_exits_on_eof(hf_model_dir):
    model = hf_model_dir("llama")
    proc = subprocess.run(_chat_cmd(model, "--max-tokens", "6"), input="hello\nhow are you\n",
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The same two turns offline: the second answer sees the first exchange.
    llm = LLM(model, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6)
    conv = [{"role": "user", "content": "hello"}]
    a1 = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
    conv += [{"role": "assistant", "content": a1}, {"role": "user", "content": "how are you"}]
    a2 = llm.chat(conv, params, use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == f"{a1}\n{a2}\n"


def test_ctrl_c_during_an_answer_exits_cleanly(hf_model_dir):
    # As from a terminal: SIGINT caught (reset to its default in the child) even when this
    # run inherited it ignored (a shell's background job ignores it, and an ignored signal
    # stays ignored across exec: Python in the child would then keep ignoring Ctrl-C).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(_chat_cmd(hf_model_dir("llama"), "--max-tokens", "400"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    proc.stdin.write("tell me a long story\n")
    proc.stdin.flush()
    first = proc.stdout.read(1)  # the answer has started streaming
    assert first
    kids = _descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        for kid in kids:
            kid.kill()
        raise AssertionError("keel chat did not exit within 30 s of Ctrl-C; its stderr:\n"
                             + proc.communicate(timeout=10)[1][-3000:]) from None
    assert code == 0
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive


def test_serve_takes_the_api_key_from_the_environment(hf_model_dir):
    port = free_port()
    env = {**os.environ, "KEEL_API_KEY": "from-env"}
    proc = subprocess.Popen([sys.executable, "-m", "keel.entrypoints.cli", "serve",
                             hf_model_dir("llama"), "--port", str(port), "--dtype", "float32",
                             "--kv-cache-memory-gib", "0.25", "--uvicorn-log-level", "warning"],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        kids = _descendants(proc.pid)
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-env"})
        assert ok.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive
