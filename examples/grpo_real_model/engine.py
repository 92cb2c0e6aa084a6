"""A small OpenAI-compatible engine serving SmolLM2 from transformers, on the CPU.

    python engine.py MODEL_DIR LOG_FILE      # prints "engine serving on http://127.0.0.1:PORT"

Owns the example's policy engine: ``POST /v1/chat/completions`` samples from the model it
holds (temperature, ``max_tokens``, ``seed``; one call at a time, in a worker thread) and
answers in vLLM's shape with ``return_token_ids``: top-level ``prompt_token_ids`` (the chat
template's ids), the choice's ``token_ids`` (the end-of-turn token included, when sampled)
and ``logprobs.content`` (each sampled token's logprob under the model's own distribution,
as vLLM returns by default), so rollpoint's ``vllm`` adapter reads them unchanged.
``POST /weights`` (``{"path", "version"}``) loads a version the trainer saved, between two
calls. Every call is appended to LOG_FILE as one JSON line: its completion id, the weights
version that sampled it, its prompt ids, token ids and logprobs: the engine's own account,
which the example's test holds the trained data to.

Tool calls: a request that offers tools is answered with a call of the first one, the
reply's whole text its one string argument (``finish_reason: "tool_calls"``, the text kept
as the message's content too, so the chat template, which renders content only, shows the
model what it said). vLLM's tool parsers read a call the model wrote in its own format; a
135M model writes none in a few tokens, so this engine's parser is the rule above: the
model's tokens are still exactly what it sampled, and an episode runs to ``max_turns``.

Not vLLM: no batching, no streaming (so the run uses ``policy.generation_cut: false``), no
pause routes (a weight update drains the calls first: rollpoint's model servers hold new
ones and wait for those in flight). The log line also carries the request's ``seed``: with
``policy.sampling.seed: turn`` it names the episode and turn that made the call.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import smollm2
import torch
from aiohttp import web

MODEL_NAME = "smollm2"


class Engine:
    def __init__(self, folder: Path, log: Path) -> None:
        self.model, self.tokenizer = smollm2.load(folder)
        self.version = 0
        self.log = log
        self.lock = threading.Lock()  # one generation or weight load at a time
        self.end_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        # The template renders every message's content (a string): a tool-calling
        # assistant message may carry none.
        messages = [{**m, "content": m.get("content") or ""} for m in body["messages"]]
        prompt = list(
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        seed = int(body.get("seed") or 0)
        generator = torch.Generator().manual_seed(seed)
        with self.lock:
            version = self.version
            ids, logprobs = self._sample(prompt, max_tokens, temperature, generator)
        finish = "stop" if ids and ids[-1] == self.end_id else "length"
        text = self.tokenizer.decode(ids[:-1] if finish == "stop" else ids)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        with self.log.open("a") as out:
            line = {"id": completion_id, "version": version, "seed": seed,
                    "prompt_token_ids": prompt, "token_ids": ids, "logprobs": logprobs}  # fmt: skip
            out.write(json.dumps(line) + "\n")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if body.get("tools"):
            tool, parameter = (
                body["tools"][0]["function"]["name"],
                _text_parameter(body["tools"][0]),
            )
            call_id = f"call_{completion_id.removeprefix('chatcmpl-')}"
            arguments = json.dumps({parameter: text})
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tool, "arguments": arguments},
                }
            ]
            finish = "tool_calls"
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        content = [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ]
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "token_ids": ids,
                    "logprobs": {"content": content},
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }

    @torch.no_grad()
    def _sample(
        self, prompt: list[int], max_tokens: int, temperature: float, generator: torch.Generator
    ) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        logprobs: list[float] = []
        out = self.model(torch.tensor([prompt]), use_cache=True)
        for _ in range(max_tokens):
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            if temperature <= 0:
                token = int(torch.argmax(logp))
            else:
                probs = torch.softmax(logp / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token == self.end_id:
                break
            out = self.model(
                torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
            )
        return ids, logprobs

    def load_weights(self, path: Path, version: int) -> None:
        with self.lock:
            smollm2.load_version(self.model, path)
            self.version = version


def create_app(engine: Engine) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]}
        )

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("stream"):
            return _error(400, "this engine does not stream")
        if not isinstance(body.get("messages"), list):
            return _error(400, "messages: a list of chat messages is required")
        tools = body.get("tools")
        if tools:
            try:
                _text_parameter(tools[0])
            except (KeyError, TypeError, ValueError) as exc:
                return _error(400, f"tools[0]: {exc}")
        return web.json_response(await asyncio.to_thread(engine.complete, body))

    async def weights(request: web.Request) -> web.Response:
        body = await request.json()
        path, version = Path(str(body.get("path"))), body.get("version")
        if not isinstance(version, int):
            return _error(400, f"weights: want a path and an integer version: {body}")
        try:
            await asyncio.to_thread(engine.load_weights, path, version)
        except (OSError, ValueError) as exc:
            return _error(400, f"weights: {path}: {exc}")
        return web.json_response({"version": version})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/weights", weights)
    return app


def _text_parameter(tool: Any) -> str:
    """The one string parameter of an OpenAI function-tool spec (what this engine fills)."""
    properties = tool["function"]["parameters"]["properties"]
    names = [n for n, p in properties.items() if isinstance(p, dict) and p.get("type") == "string"]
    if len(properties) != 1 or len(names) != 1:
        raise ValueError("this engine calls a tool with exactly one string parameter")
    return names[0]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def serve(folder: Path, log: Path) -> None:
    runner = web.AppRunner(create_app(Engine(folder, log)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"engine serving on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1]), Path(sys.argv[2])))
