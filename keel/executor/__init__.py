from keel.executor.abstract import Executor

__all__ = ["Executor"]
