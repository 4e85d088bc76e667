"""The routes over AsyncLLM: completions and chat completions (a generation model), and
embeddings (a pooling model, served with --runner pooling).

Each request is checked whole (the pydantic model, then every prompt through the engine's
InputProcessor) before anything is sent: a bad one is a 400 and costs the others nothing. A
streamed response is Server-Sent Events, one chunk per step's delta and `data: [DONE]` at the
end; a client that goes away closes the output iterators, which aborts their requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from keel.engine.async_llm import AsyncLLM
from keel.engine.core_client import EngineDeadError
from keel.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    UsageInfo,
    random_uuid,
)
from keel.entrypoints.openai.responses import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    chat_logprobs,
    completion_logprobs,
    encode_embedding,
)
from keel.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from keel.pooling_params import PoolingParams
from keel.sampling_params import SamplingParams


class ServingError(Exception):
    """An error for the client, with its HTTP status and the request field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.err_type = message, status, param, err_type


def _sse(payload: Any) -> str:
    body = payload.model_dump_json(exclude_none=False) if hasattr(payload, "model_dump_json") \
        else json.dumps(payload)
    return f"data: {body}\n\n"


async def _merge(streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the stream's index.
    Closing this iterator closes (and so aborts) every stream still running."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        raise ServingError(
            f"The model `{model}` does not exist. Served: {self.served_model_names}.",
            status=404, param="model", err_type="NotFoundError")

    def check_generates(self) -> None:
        if self.engine.model_config.runner_type == "pooling":
            raise ServingError("This model is served for embeddings (--runner pooling): it "
                               "does not generate text. Use /v1/embeddings, or serve a "
                               "generation model.", param="model")

    @staticmethod
    def _param_of(message: str) -> str | None:
        """The request field an engine error is about."""
        return "prompt" if "prompt" in message else None

    def _add(self, prompt: str | dict, params: SamplingParams | PoolingParams, request_id: str
             ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        add = self.engine.add_pooling_request if isinstance(params, PoolingParams) \
            else self.engine.add_request
        try:
            return add(prompt, params, request_id)
        except (ValueError, TypeError) as e:
            raise ServingError(str(e), param=self._param_of(str(e))) from e
        except EngineDeadError as e:
            raise ServingError(str(e), status=503, err_type="ServiceUnavailableError") from e

    def _add_all(self, prompts: list[str | dict], params: SamplingParams | PoolingParams,
                 base_id: str) -> list[AsyncIterator[RequestOutput | PoolingRequestOutput]]:
        """Add every prompt's request, or none: a bad prompt aborts those already added."""
        streams: list[AsyncIterator[RequestOutput | PoolingRequestOutput]] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(self._add(prompt, params, f"{base_id}-{i}"))
        except ServingError:
            for request_id in (f"{base_id}-{i}" for i in range(len(streams))):
                self.engine.abort(request_id)
            raise
        return streams

    @staticmethod
    def _stream_error(e: Exception) -> str:
        status = 503 if isinstance(e, EngineDeadError) else 500
        return _sse({"error": {"message": str(e), "type": type(e).__name__, "param": None,
                               "code": status}})


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, request: CompletionRequest) -> list[str | dict]:
        p = request.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [{"prompt_token_ids": p}]
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]

    async def create_completion(self, request: CompletionRequest):
        model = self.check_model(request.model)
        self.check_generates()
        try:
            params = request.to_sampling_params(None)
        except ValueError as e:
            raise ServingError(str(e)) from e
        request_id = f"cmpl-{random_uuid()}"
        streams = self._add_all(self._prompts(request), params, request_id)
        if request.stream:
            return self._stream(request, model, request_id, streams)
        return await self._full(request, model, request_id, streams)

    def _echo_prefix(self, request: CompletionRequest, out: RequestOutput) -> str:
        if not request.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer else ""

    def _logprobs(self, request: CompletionRequest, c: CompletionOutput, offset: int,
                  echoed: RequestOutput | None = None):
        """The choice's logprobs; with `echoed` (echo, first chunk) the prompt's come first
        (its first token has none)."""
        if request.logprobs is None or c.logprobs is None:
            return None
        token_ids, logprobs = c.token_ids, c.logprobs
        if echoed is not None and echoed.prompt_logprobs is not None:
            token_ids = list(echoed.prompt_token_ids) + list(token_ids)
            logprobs = list(echoed.prompt_logprobs) + list(logprobs)
        return completion_logprobs(token_ids, logprobs, self.tokenizer, offset)

    async def _full(self, request, model, request_id, streams) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge(streams):
                if out.finished:
                    finals[i] = out
        except EngineDeadError as e:
            raise ServingError(str(e), status=503, err_type="ServiceUnavailableError") from e
        choices, usage = [], UsageInfo()
        for i in range(len(streams)):
            out = finals[i]
            usage.prompt_tokens += len(out.prompt_token_ids)
            prefix = self._echo_prefix(request, out)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(CompletionResponseChoice(
                    index=i * request.n + c.index, text=prefix + c.text,
                    logprobs=self._logprobs(request, c, 0, out if request.echo else None),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, request, model, request_id, streams) -> AsyncIterator[str]:
        usage = UsageInfo()
        offsets: dict[tuple[int, int], int] = {}  # (prompt, choice) -> text sent so far
        seen: set[int] = set()  # prompts whose first output arrived (counted in usage)
        try:
            async for i, out in _merge(streams):
                if i not in seen:
                    seen.add(i)
                    usage.prompt_tokens += len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    key = (i, c.index)
                    first = key not in offsets
                    prefix = self._echo_prefix(request, out) if first else ""
                    if not (c.text or prefix or c.finish_reason or c.logprobs):
                        continue  # tokens that do not complete a character yet
                    offset = offsets.get(key, 0)
                    offsets[key] = offset + len(prefix) + len(c.text)
                    echoed = out if first and request.echo else None
                    choices.append(CompletionResponseChoice(
                        index=i * request.n + c.index, text=prefix + c.text,
                        logprobs=self._logprobs(request, c, offset, echoed),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
                if choices:
                    yield _sse(CompletionStreamResponse(id=request_id, model=model,
                                                        choices=choices))
            if request.stream_options is not None and request.stream_options.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield _sse(CompletionStreamResponse(id=request_id, model=model, choices=[],
                                                    usage=usage))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            yield self._stream_error(e)
        yield "data: [DONE]\n\n"


class OpenAIServingChat(OpenAIServing):
    def _prompt(self, request: ChatCompletionRequest) -> dict:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ServingError("This model has no chat template: use /v1/completions.",
                               param="messages")
        conversation = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = tok.apply_chat_template(
                conversation, add_generation_prompt=request.add_generation_prompt,
                tokenize=False, **(request.chat_template_kwargs or {}))
        except Exception as e:  # a template that rejects the conversation
            raise ServingError(f"The chat template could not render these messages: {e}",
                               param="messages") from e
        return {"prompt_token_ids": tok.encode(text, add_special_tokens=False), "prompt": text}

    def _logprobs(self, request: ChatCompletionRequest, c: CompletionOutput):
        if not request.logprobs or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids, c.logprobs, self.tokenizer, request.top_logprobs or 0)

    async def create_chat_completion(self, request: ChatCompletionRequest):
        model = self.check_model(request.model)
        self.check_generates()
        prompt = self._prompt(request)
        try:
            params = request.to_sampling_params(None)
        except ValueError as e:
            raise ServingError(str(e)) from e
        request_id = f"chatcmpl-{random_uuid()}"
        streams = self._add_all([prompt], params, request_id)
        if request.stream:
            return self._stream(request, model, request_id, streams)
        final = None
        try:
            async for _, out in _merge(streams):
                final = out if out.finished else final
        except EngineDeadError as e:
            raise ServingError(str(e), status=503, err_type="ServiceUnavailableError") from e
        choices = [
            ChatCompletionResponseChoice(
                index=c.index, message=ChatResponseMessage(content=c.text),
                logprobs=self._logprobs(request, c), finish_reason=c.finish_reason,
                stop_reason=c.stop_reason)
            for c in final.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo(prompt_tokens=len(final.prompt_token_ids),
                          completion_tokens=completion_tokens,
                          total_tokens=len(final.prompt_token_ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, request, model, request_id, streams) -> AsyncIterator[str]:
        def chunk(choices, usage=None):
            return _sse(ChatCompletionStreamResponse(id=request_id, model=model,
                                                     choices=choices, usage=usage))

        usage = UsageInfo()
        try:
            # OpenAI's first chunk of each choice carries the role and no content.
            yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(
                role="assistant", content=""), logprobs=None, finish_reason=None)
                for i in range(request.n)])
            async for _, out in _merge(streams):
                usage.prompt_tokens = len(out.prompt_token_ids)
                choices = []
                for c in out.outputs:
                    usage.completion_tokens += len(c.token_ids)
                    if not (c.text or c.finish_reason or c.logprobs):
                        continue  # tokens that do not complete a character yet
                    choices.append(ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.text),
                        logprobs=self._logprobs(request, c), finish_reason=c.finish_reason))
                if choices:
                    yield chunk(choices)
            if request.stream_options is not None and request.stream_options.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield chunk([], usage)
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            yield self._stream_error(e)
        yield "data: [DONE]\n\n"


class OpenAIServingEmbedding(OpenAIServing):
    @staticmethod
    def _param_of(message: str) -> str | None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            if message.startswith(name):
                return name
        return "input"

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Every input is submitted at once (the engine batches them); the vectors come back
        in input order."""
        model = self.check_model(request.model)
        if self.engine.model_config.runner_type != "pooling":
            raise ServingError("This model does not embed: it generates text. Serve it with "
                               "--runner pooling to get embeddings from it.", param="model")
        try:
            params = PoolingParams(task="embed", dimensions=request.dimensions,
                                   truncate_prompt_tokens=request.truncate_prompt_tokens)
        except ValueError as e:
            raise ServingError(str(e), param=self._param_of(str(e))) from e
        request_id = f"embd-{random_uuid()}"
        streams = self._add_all(request.prompts(), params, request_id)
        finals: dict[int, PoolingRequestOutput] = {}
        try:
            async for i, out in _merge(streams):
                finals[i] = out
        except EngineDeadError as e:
            raise ServingError(str(e), status=503, err_type="ServiceUnavailableError") from e
        data = [EmbeddingData(index=i, embedding=encode_embedding(finals[i].outputs.data,
                                                                  request.encoding_format))
                for i in range(len(streams))]
        num_tokens = sum(len(out.prompt_token_ids) for out in finals.values())
        return EmbeddingResponse(id=request_id, model=model, data=data, usage=EmbeddingUsage(
            prompt_tokens=num_tokens, total_tokens=num_tokens))
