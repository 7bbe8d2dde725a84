"""The LoRA adapters a server applies: those of the command line and those loaded while serving
(POST /lora-adapters/load) from under --lora-dir.

A file is loaded once: loading it again answers with the adapter already loaded (its default
scale set to the request's). At most `limit` adapters (--lora-max) are loaded, so that clients
cannot grow the server's memory and each step's adapter bookkeeping without bound; past it a
load is a 409. Loads run one at a time, in a worker thread (reading a file and taking the
engine's lock, which the decode loop holds during a step, never stall the event loop).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from llamapy.errors import LlamapyError

from .engine import Engine
from .errors import ApiError
from .limits import DEFAULT_MAX_ADAPTERS


class Adapters:
    """The engine's adapters by id, with the paths they were read from."""

    def __init__(self, engine: Engine, paths: list[str], lora_dir: Path | None,
                 limit: int = DEFAULT_MAX_ADAPTERS) -> None:
        self.engine, self.paths, self.limit = engine, list(paths), limit
        self.lora_dir = lora_dir.resolve() if lora_dir else None
        self._loading = asyncio.Lock()

    def listing(self) -> list[dict]:
        """GET /lora-adapters: each adapter's id, path and default scale."""
        return [{"id": i, "path": p, "scale": s} for i, (p, s) in enumerate(zip(self.paths, self.engine.scales))]

    def set_scales(self, scales: tuple[float, ...]) -> None:
        """The default scales of requests without their own (taken between two steps)."""
        with self.engine.lock:
            self.engine.scales[:] = scales

    async def load(self, given: str, scale: float) -> dict:
        """POST /lora-adapters/load: the adapter at `given` (under --lora-dir) at `scale`."""
        if self.lora_dir is None:
            raise ApiError(403, "loading adapters is off: start the server with --lora-dir DIR")
        async with self._loading:
            return await asyncio.to_thread(self._load, given, scale)

    def _load(self, given: str, scale: float) -> dict:
        path = self._resolve(given)
        for i, known in enumerate(self.paths):
            if Path(known).resolve() == path:
                with self.engine.lock:
                    self.engine.scales[i] = scale
                return {"id": i, "path": known, "scale": scale}
        if len(self.paths) >= self.limit:
            raise ApiError(409, f"{len(self.paths)} adapters are loaded, the most this server takes (--lora-max "
                                f"{self.limit}): restart it to load others")
        from llamapy.lora import LoraAdapter
        try:
            adapter = LoraAdapter.load(path, self.engine.ctx.model)
        except LlamapyError as e:
            raise ApiError(400, str(e)) from None
        with self.engine.lock:
            self.engine.adapters.append(adapter)
            self.engine.scales.append(scale)
            self.paths.append(str(path))
        return {"id": len(self.paths) - 1, "path": str(path), "scale": scale}

    def _resolve(self, given: str) -> Path:
        """`given` (relative to --lora-dir, or absolute) as a file under --lora-dir."""
        path = Path(given)
        try:
            path = (path if path.is_absolute() else self.lora_dir / path).resolve()
            if not path.is_relative_to(self.lora_dir):
                raise ApiError(403, f"{given}: not under the --lora-dir {self.lora_dir}")
            if not path.is_file():
                raise ApiError(404, f"{given}: no such adapter file under --lora-dir")
        except OSError as e:  # a name too long for this file system, ...
            raise ApiError(400, f"{given}: {e.strerror or e}") from None
        except RuntimeError:  # Python 3.11's resolve() on a loop of symbolic links
            raise ApiError(400, f"{given}: a loop of symbolic links") from None
        return path
