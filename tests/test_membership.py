"""The balancer's membership watcher says when no controller answers, also when the network holds its calls."""

from __future__ import annotations

import asyncio

import aiohttp

from skylb.balancer.membership import MembershipWatcher
from tests.procs import free_port


def test_a_heartbeat_no_controller_answers_marks_the_controller_unreachable(tmp_path):
    """A controller behind a blackhole (it accepts connections and never answers): the watch's long poll would wait
    for its whole wait plus timeout, but the first heartbeat that times out already sets controller_reachable to
    False, so the status says the balancer serves on its last membership."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing: a blackholed path

    async def run() -> bool:
        port = free_port()
        server = await asyncio.start_server(silent, "127.0.0.1", port)
        async with aiohttp.ClientSession() as session:
            watcher = MembershipWatcher(region="us", advertise_url="http://127.0.0.1:9",
                                        controller_url=f"http://127.0.0.1:{port}", state_dir=str(tmp_path),
                                        apply=lambda snapshot: None, session=session, heartbeat_s=0.05,
                                        timeout_s=0.3)
            watcher.controller_reachable = True  # as after a first answer
            task = asyncio.create_task(watcher._heartbeat())
            try:
                for _ in range(50):  # bounded: 2.5 s
                    if not watcher.controller_reachable:
                        break
                    await asyncio.sleep(0.05)
                return watcher.controller_reachable
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                for writer in held:
                    writer.close()
                server.close()
                await server.wait_closed()

    assert asyncio.run(run()) is False
