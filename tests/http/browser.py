"""Drives the page at `/` in Debian's chromium, headless, over the DevTools protocol on a pipe
(stdlib only): submits a prompt, and checks that the <video> buffered and played frames before
the job reported completed, then that the whole video played. Saves a screenshot. Run by
tests/http_api.rs with the server's URL, the screenshot path and the frame count; prints a JSON
report, exits non-zero with the reason on failure."""

import base64
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time

url, screenshot, frames = sys.argv[1], sys.argv[2], int(sys.argv[3])

# The browser reads commands on fd 3 and writes answers on fd 4 (--remote-debugging-pipe).
to_browser_r, to_browser_w = os.pipe()
from_browser_r, from_browser_w = os.pipe()
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)]


def child_fds():
    os.dup2(high[0], 3)
    os.dup2(high[1], 4)


profile = tempfile.mkdtemp(prefix="ditstream-chromium-")
browser = subprocess.Popen(
    [
        "chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--mute-audio",
        "--autoplay-policy=no-user-gesture-required", "--remote-debugging-pipe",
        f"--user-data-dir={profile}", "--window-size=900,900", "about:blank",
    ],
    preexec_fn=child_fds, close_fds=False,
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
os.close(to_browser_r)
os.close(from_browser_w)
pending = b""
next_id = 0


def call(method, params=None, session=None, timeout=30):
    """One DevTools command; its result (events in between are skipped)."""
    global pending, next_id
    next_id += 1
    message = {"id": next_id, "method": method, "params": params or {}}
    if session:
        message["sessionId"] = session
    os.write(to_browser_w, json.dumps(message).encode() + b"\0")
    deadline = time.time() + timeout
    while True:
        while b"\0" not in pending:
            assert time.time() < deadline, f"no answer to {method}"
            chunk = os.read(from_browser_r, 1 << 20)
            assert chunk, "the browser closed its pipe"
            pending += chunk
        raw, pending = pending.split(b"\0", 1)
        answer = json.loads(raw)
        if answer.get("id") == next_id:
            assert "error" not in answer, f"{method}: {answer['error']}"
            return answer["result"]


def js(expression, session):
    result = call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
    assert "exceptionDetails" not in result, result["exceptionDetails"]
    return result["result"].get("value")


try:
    target = call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    call("Page.enable", session=session)
    call("Page.navigate", {"url": url}, session)
    while js("document.readyState", session) != "complete":
        time.sleep(0.05)
    codecs = js('MediaSource.isTypeSupported(\'video/mp4; codecs="avc1.42c00a"\')', session)
    assert codecs, "this chromium's Media Source Extensions cannot play H.264"
    js(f"""document.getElementById('prompt').value = 'a fox in the browser';
           document.getElementById('steps').value = '2';
           document.getElementById('seconds').value = '{(frames - 1) / 16}';
           document.getElementById('form').requestSubmit(); true""", session)
    state = """JSON.stringify({status: window.ditstream.status,
        played: window.ditstream.firstPlayedBeforeDone,
        time: document.getElementById('video').currentTime,
        ended: document.getElementById('video').ended,
        buffered: document.getElementById('video').buffered.length,
        frames: document.getElementById('video').getVideoPlaybackQuality().totalVideoFrames,
        text: document.getElementById('status').textContent})"""
    start = time.time()
    seen_before_done = None
    while True:
        s = json.loads(js(state, session))
        playing = s["buffered"] > 0 and s["frames"] > 0 and s["time"] > 0
        if s["status"] in ("in_progress", "queued") and playing:
            seen_before_done = seen_before_done or s
        if s["status"] in ("completed", "failed", "error"):
            break
        assert time.time() - start < 300, s
        time.sleep(0.05)
    assert s["status"] == "completed", s
    assert seen_before_done, f"nothing buffered and played before completion: {s}"
    while not s["ended"]:
        assert time.time() - start < 300, s
        time.sleep(0.1)
        s = json.loads(js(state, session))
    shot = call("Page.captureScreenshot", {"format": "png"}, session)
    with open(screenshot, "wb") as f:
        f.write(base64.b64decode(shot["data"]))
    print(json.dumps({"before_done": seen_before_done, "end": s}))
finally:
    browser.kill()
    browser.wait()
