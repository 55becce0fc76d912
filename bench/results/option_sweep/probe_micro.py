import asyncio, os, sys, time, subprocess
import aiohttp
from yarl import URL
BODY = ("# HELP x\n" + "".join(f'vllm:metric_{i}{{model_name="m"}} {i}.0\n' for i in range(60))).encode()
async def server():
    from aiohttp import web
    app = web.Application()
    async def h(req): return web.Response(body=BODY, content_type="text/plain")
    app.router.add_get("/metrics", h)
    r = web.AppRunner(app, access_log=None); await r.setup(); s = web.TCPSite(r, "127.0.0.1", 18123); await s.start()
    await asyncio.sleep(3600)
async def client(mode, n=3000):
    kw = {}
    if "jar" in mode: kw["cookie_jar"] = aiohttp.DummyCookieJar()
    s = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), connector=aiohttp.TCPConnector(limit=0), **kw)
    url = "http://127.0.0.1:18123" ; u = URL(url + "/metrics")
    t = aiohttp.ClientTimeout(total=2)
    for _ in range(200):
        async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp: await resp.read()
    c0 = time.process_time()
    for _ in range(n):
        if "url" in mode:
            async with s.get(u, timeout=t) as resp: await resp.read()
        else:
            async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp: await resp.read()
    c = time.process_time() - c0
    await s.close()
    return c / n * 1e6
if sys.argv[1] == "server":
    import uvloop; uvloop.install(); asyncio.run(server())
else:
    import uvloop; uvloop.install()
    for mode in ["base", "jar", "url", "jar+url", "base", "jar+url"]:
        print(mode, round(asyncio.run(client(mode)), 1), "us CPU/probe")
