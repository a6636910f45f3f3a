"""Drives ditstream's Videos API with the official `openai` SDK, unchanged, as any client of
OpenAI's Videos API would. Run by tests/http_api.rs with the base URL and an output folder;
exits non-zero (with the reason) if anything differs from what the SDK expects."""

import json
import sys
import time

from openai import OpenAI

base_url, out = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key="not-checked-on-loopback", max_retries=0)


def wait(video_id, done=("completed", "failed"), timeout=600):
    start = time.time()
    while True:
        video = client.videos.retrieve(video_id)
        if video.status in done:
            return video
        assert time.time() - start < timeout, f"{video_id} still {video.status}"
        time.sleep(0.1)


# Create, poll until completed, download, list.
video = client.videos.create(
    prompt="a red fox running through snow",
    size="256x160",
    seconds="1",
    extra_body={"num_inference_steps": 2, "seed": 5},
)
assert video.object == "video" and video.status in ("queued", "in_progress"), video
video = wait(video.id)
assert video.status == "completed" and video.progress == 100, video
assert video.size == "256x160" and video.seconds == "1", video
assert video.completed_at and video.expires_at and video.expires_at > video.completed_at, video
client.videos.download_content(video.id).write_to_file(f"{out}/sdk.mp4")
thumbnail = client.videos.download_content(video.id, variant="thumbnail")
assert thumbnail.content[:8] == b"\x89PNG\r\n\x1a\n", thumbnail.content[:16]
thumbnail.write_to_file(f"{out}/thumbnail.png")
listed = [v.id for v in client.videos.list()]
assert video.id in listed, listed

# Delete a running job: its work stops, and the job queued behind it starts at once.
long = client.videos.create(
    prompt="a long one", size="64x48", seconds="0.25", extra_body={"num_inference_steps": 100}
)
while True:
    current = client.videos.retrieve(long.id)
    if current.status == "in_progress" and current.progress >= 6:  # denoising has begun
        break
    time.sleep(0.02)
after = client.videos.create(
    prompt="the next one", size="64x48", seconds="0.25", extra_body={"num_inference_steps": 2}
)
assert client.videos.retrieve(after.id).status == "queued"
deleted = client.videos.delete(long.id)
assert deleted.deleted is True and deleted.id == long.id, deleted
t = time.time()
while client.videos.retrieve(after.id).status == "queued":
    time.sleep(0.01)
started_s = time.time() - t
finished = wait(after.id)
assert finished.status == "completed", finished
gone = [v.id for v in client.videos.list()]
assert long.id not in gone, gone

# A request that breaks a limit is the SDK's BadRequestError, naming the parameter.
try:
    client.videos.create(prompt="a narrow one", size="7x16", seconds="1")
    raise AssertionError("a 7-pixel width was accepted")
except Exception as e:  # openai.BadRequestError
    assert type(e).__name__ == "BadRequestError", repr(e)
    assert e.param == "size" and "width = 7" in e.message, (e.param, e.message)

# An unknown id is the SDK's NotFoundError.
try:
    client.videos.retrieve("req-00000000000000000000000000000000")
    raise AssertionError("an unknown video was found")
except Exception as e:  # openai.NotFoundError
    assert type(e).__name__ == "NotFoundError", repr(e)

print(json.dumps({"id": video.id, "next_started_s": started_s}))
