"""n > 1: one user request fans out into n independent child requests in the engine core
(each is scheduled, cached and sampled like any other), and their outputs are gathered back
under the parent's id here."""

from __future__ import annotations

from keel.outputs import CompletionOutput
from keel.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        # Children handed out and not yet finished (or aborted).
        self.child_requests: set[str] = set()
        # FINAL_ONLY: the finished completions, by index, until all n are in.
        self._final: list[CompletionOutput | None] = (
            [None] * sampling_params.n
            if sampling_params.output_kind == RequestOutputKind.FINAL_ONLY else []
        )

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id and params of child `index`. A seeded parent gives each child its own seed
        (seed + index), so the n samples differ yet the whole request is reproducible."""
        child_id = f"{index}_{self.request_id}"
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed = self.sampling_params.seed + index
        self.child_requests.add(child_id)
        return child_id, params

    def remove_child(self, child_request_id: str) -> None:
        """Forget an aborted child: the parent finishes with the others."""
        self.child_requests.discard(child_request_id)

    def get_outputs(
        self, child_request_id: str, completion: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """What to send for the parent now, and whether the parent is finished.

        Streaming kinds pass each child's completion straight through (the user tells them
        apart by `index`); FINAL_ONLY sends nothing until the last child finishes, then all
        completions in index order."""
        already_returned = False
        if completion.finished:
            if child_request_id in self.child_requests:
                self.child_requests.discard(child_request_id)
            else:
                already_returned = True  # finished and sent before: never send it twice
        finished = not self.child_requests
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            return ([] if already_returned else [completion]), finished
        if completion.finished and 0 <= completion.index < len(self._final):
            self._final[completion.index] = completion
        if not finished or already_returned:
            return [], finished
        return [c for c in self._final if c is not None], finished
