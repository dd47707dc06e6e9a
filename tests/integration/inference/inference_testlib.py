"""Helpers of the inference integration tests: the tiny and tool models, real `gyre inference` processes.

`InferenceProcess` runs `python -m gyre.cli inference ...` on free ports (port 0, read back from the
`ready:` line), in its own process group, and stops it with SIGTERM (the graceful path under test);
the finalizer kills the group if it is still alive.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"^ready: (http://\S+) control: (\S+) version: (\d+)$")


def make_tiny_model(tmp_path_factory) -> Path:
    """The `tiny` preset, created once per session (shared by every inference test module)."""
    from gyre.model_init import init_model

    path = tmp_path_factory.getbasetemp() / "inference-tiny-model"
    if not (path / "config.json").exists():
        init_model(path, preset="tiny", seed=0)
    return path


# A tiny model fine-tuned (in the fixture, ~100 steps) to answer TOOL_MESSAGES with TOOL_ANSWER under greedy
# decoding, so tool-call parsing is tested on text the model really generates.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
TOOL_MESSAGES = [{"role": "user", "content": "What is 1 plus 2?"}]
TOOL_ANSWER = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'


def make_tool_model(tmp_path_factory) -> Path:
    """Fine-tune the tiny model until greedy decoding of the tool prompt yields TOOL_ANSWER with margin."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.getbasetemp() / "inference-tool-model"
    if (path / "config.json").exists():
        return path
    base = make_tiny_model(tmp_path_factory)
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = tokenizer.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(TOOL_ANSWER, add_special_tokens=False)
    ids = torch.tensor([prompt_ids + answer_ids])
    labels = ids.clone()
    labels[0, : len(prompt_ids)] = -100
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads than free cores makes this many times slower on a busy machine
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    try:
        for _ in range(400):
            out = model(input_ids=ids, labels=labels)
            logits = out.logits[0, len(prompt_ids) - 1 : -1].detach()
            top2 = logits.topk(2, dim=-1)
            learned = top2.indices[:, 0].tolist() == answer_ids
            if learned and float((top2.values[:, 0] - top2.values[:, 1]).min()) > 1.0:
                break
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        else:
            raise RuntimeError("the tool model did not learn its answer")
    finally:
        torch.set_num_threads(threads)
    staging = path.with_name(path.name + ".tmp")
    model.save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, staging / name)
    staging.rename(path)
    return path


class InferenceProcess:
    def __init__(self, model: Path, *args: str, log_dir: Path, timeout: float = 120.0):
        self.model_name = str(model)  # the served model id (no served_model_name given)
        self.log_path = log_dir / f"inference-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "gyre.cli", "inference", "--model.name", str(model), "--server.port", "0",
               "--control.port", "0", "--engine.threads", "1", "--server.shutdown-grace-s", "20", *args]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, start_new_session=True, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                self.kill()
                raise RuntimeError(f"inference server did not become ready; log:\n{self.log()}")
            if match := READY.match(line.strip()):
                self.url, self.control, self.start_version = match.group(1), match.group(2), int(match.group(3))
                break
        self.base_url = self.url + "/v1"

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for a graceful exit; returns the exit status (killed = negative)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
