"""The benchmark's workload: conversations of turns with synthetic images, clips and prompts, fixed by a seed.

Everything here is plain Python (no server, no model): the same seed and settings give the same
conversations, image bytes and arrival times, so the epd run and the transformers baseline see
an identical workload, and two invocations are comparable.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from bench.synthetic import make_clip, make_image

_SIZE = re.compile(r"^\s*(\d+)x(\d+)(?::([0-9]*\.?[0-9]+))?\s*$")

# Plain words to build prompts from; the exact text does not matter, only its length in tokens.
WORDS = (
    "the a picture image shows small large red blue green white black dog cat car bicycle wall window "
    "street city house tree river bridge people person child woman man table chair book light shadow "
    "morning afternoon evening sun rain cloud sky road market shop stone wood glass paper water field "
    "describe explain count compare what where how many which colour shape left right near behind above "
    "below between there is are was were has have with without and or but because while after before "
    "quiet busy old new bright dark warm cold long short narrow wide open closed sitting standing walking"
).split()


@dataclass(frozen=True)
class ImageSize:
    """One entry of ``--image-sizes``: a size and its relative weight when choosing a size."""

    width: int
    height: int
    weight: float = 1.0

    def __str__(self) -> str:
        return f"{self.width}x{self.height}:{self.weight:g}"


def parse_image_sizes(text: str) -> tuple[ImageSize, ...]:
    """``"448x448,1280x720:3"`` -> sizes; raises ValueError naming the bad entry."""
    sizes = []
    for entry in text.split(","):
        match = _SIZE.match(entry)
        if not match:
            raise ValueError(f"expected WIDTHxHEIGHT[:WEIGHT], got {entry.strip()!r}")
        width, height = int(match[1]), int(match[2])
        weight = float(match[3]) if match[3] is not None else 1.0
        if width < 1 or height < 1:
            raise ValueError(f"image size {entry.strip()!r}: width and height must be at least 1")
        if weight <= 0:
            raise ValueError(f"image size {entry.strip()!r}: the weight must be positive")
        sizes.append(ImageSize(width, height, weight))
    return tuple(sizes)


@dataclass(frozen=True)
class BenchImage:
    """An image of the workload; ``index`` names its bytes (a repeat shares an earlier index)."""

    index: int
    width: int
    height: int
    data: bytes


@dataclass(frozen=True)
class BenchVideo:
    """A clip of the workload (an MP4 made with PyAV); ``index`` names its bytes (a repeat shares an
    earlier index); ``sampled_frames`` is how many frames the server's sampling takes from it."""

    index: int
    width: int
    height: int
    num_frames: int
    fps: float
    sampled_frames: int
    data: bytes


@dataclass(frozen=True)
class Turn:
    """One user message: its images first, then its clips, then its text (the chapter's layout)."""

    text: str
    images: tuple[BenchImage, ...]
    videos: tuple[BenchVideo, ...] = ()


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another, each resending the earlier turns and their answers."""

    index: int
    turns: tuple[Turn, ...]
    arrival_s: float  # seconds after the run starts (0 for every conversation in closed-loop runs)


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    images_per_request: int
    image_sizes: tuple[ImageSize, ...]
    prompt_tokens: int
    repeat_ratio: float = 0.0
    turns: int = 1
    request_rate: float | None = None  # conversations per second (Poisson); None: all arrive at once
    seed: int = 0
    num_warmup: int = 0  # untimed single-turn requests sent before the run
    videos_per_request: int = 0  # new clips in each conversation's first turn
    video_sizes: tuple[ImageSize, ...] = ()
    video_seconds: float = 4.0  # each clip's length
    video_fps: float = 8.0  # the clips' frame rate as written in the file (the server samples at its own fps)


@dataclass(frozen=True)
class Workload:
    conversations: tuple[Conversation, ...]
    num_requests: int
    num_unique_images: int
    num_repeated_images: int  # images whose bytes reuse an earlier image's
    warmup: tuple[Turn, ...] = ()  # like the run's first turns, with images and clips of their own (no cache hits)
    num_unique_videos: int = 0
    num_repeated_videos: int = 0  # clips whose bytes reuse an earlier clip's


class PromptMaker:
    """Texts of about ``num_tokens`` tokens from random words.

    With a tokenizer the text is the longest run of words whose token count is at most the
    target (checked by tokenizing it); without one, one word per token is the estimate.
    """

    def __init__(self, count_tokens: Callable[[str], int] | None = None) -> None:
        self.count_tokens = count_tokens

    @classmethod
    def from_model_dir(cls, model_dir: str) -> PromptMaker:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return cls(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))

    def make(self, rng: random.Random, num_tokens: int) -> str:
        words = [rng.choice(WORDS) for _ in range(num_tokens)]
        if self.count_tokens is None:
            return " ".join(words)
        while self.count_tokens(" ".join(words)) < num_tokens:  # a tokenizer may join words
            words += [rng.choice(WORDS) for _ in range(num_tokens)]
        if self.count_tokens(words[0]) > num_tokens:  # not even one word fits: the shortest word there is
            return min(WORDS, key=self.count_tokens)
        low, high = 1, len(words)  # the longest prefix with at most num_tokens tokens
        while low < high:
            mid = (low + high + 1) // 2
            if self.count_tokens(" ".join(words[:mid])) <= num_tokens:
                low = mid
            else:
                high = mid - 1
        return " ".join(words[:low])


def turns_per_conversation(num_requests: int, turns: int) -> list[int]:
    """Split ``num_requests`` into conversations of ``turns`` turns; the last one may be shorter."""
    full, rest = divmod(num_requests, turns)
    return [turns] * full + ([rest] if rest else [])


def arrival_times(num: int, request_rate: float | None, seed: int) -> list[float]:
    """Poisson arrivals (exponential gaps) at ``request_rate`` per second; all at 0 without a rate."""
    if request_rate is None:
        return [0.0] * num
    rng = random.Random(f"{seed}:arrivals")  # its own stream: the rate does not change the content
    times, now = [], 0.0
    for _ in range(num):
        now += rng.expovariate(request_rate)
        times.append(now)
    return times


class _ImagePool:
    """Draws images: a new one of a weighted random size, or with ``repeat_ratio`` an earlier one."""

    def __init__(self, spec: WorkloadSpec, rng: random.Random) -> None:
        self.spec = spec
        self.rng = rng
        self.images: list[BenchImage] = []
        self.num_repeats = 0

    def draw(self) -> BenchImage:
        if self.images and self.rng.random() < self.spec.repeat_ratio:
            self.num_repeats += 1
            return self.rng.choice(self.images)
        sizes = self.spec.image_sizes
        size = self.rng.choices(sizes, weights=[s.weight for s in sizes])[0]
        image_seed = self.rng.getrandbits(31)
        image = BenchImage(len(self.images), size.width, size.height, make_image(size.width, size.height, image_seed))
        self.images.append(image)
        return image


class _ClipPool:
    """Draws clips as ``_ImagePool`` draws images, from its own random stream (so adding clips to a
    workload leaves its images and prompts as they were)."""

    def __init__(self, spec: WorkloadSpec, count_frames: Callable[[bytes], int]) -> None:
        self.spec = spec
        self.rng = random.Random(f"{spec.seed}:videos")
        self.count_frames = count_frames
        self.videos: list[BenchVideo] = []
        self.num_repeats = 0

    def draw(self) -> BenchVideo:
        if self.videos and self.rng.random() < self.spec.repeat_ratio:
            self.num_repeats += 1
            return self.rng.choice(self.videos)
        video = self.make(len(self.videos), self.rng.getrandbits(31))
        self.videos.append(video)
        return video

    def make(self, index: int, seed: int) -> BenchVideo:
        sizes = self.spec.video_sizes
        size = random.Random(seed).choices(sizes, weights=[s.weight for s in sizes])[0]
        num_frames = max(1, round(self.spec.video_seconds * self.spec.video_fps))
        data = make_clip(size.width, size.height, num_frames, fps=self.spec.video_fps, seed=seed)
        return BenchVideo(index, size.width, size.height, num_frames, self.spec.video_fps, self.count_frames(data),
                          data)


def sampled_frames(settings=None) -> Callable[[bytes], int]:
    """How many frames the server samples from a clip (``epd.video``'s rules with ``settings``, the
    checkpoint's ``VideoSettings``; None: transformers' defaults, for a router whose checkpoint is not here)."""
    from epd import video

    settings = settings or video.VideoSettings()
    return lambda data: len(video.probe_video(data, settings).indices)


def build_workload(spec: WorkloadSpec, prompts: PromptMaker, video_settings=None) -> Workload:
    """The conversations of a run. Only the first turn of a conversation carries new images and
    clips; later turns add a new user text and resend the earlier ones (so every request has the
    same images and clips). ``video_settings``: the server's, to count the frames it samples."""
    rng = random.Random(spec.seed)
    pool = _ImagePool(spec, rng)
    clips = _ClipPool(spec, sampled_frames(video_settings)) if spec.videos_per_request else None
    lengths = turns_per_conversation(spec.num_requests, spec.turns)
    arrivals = arrival_times(len(lengths), spec.request_rate, spec.seed)
    conversations = []
    for index, (num_turns, arrival) in enumerate(zip(lengths, arrivals)):
        images = tuple(pool.draw() for _ in range(spec.images_per_request))
        videos = tuple(clips.draw() for _ in range(spec.videos_per_request)) if clips else ()
        turns = [Turn(prompts.make(rng, spec.prompt_tokens), images, videos)]
        turns += [Turn(prompts.make(rng, spec.prompt_tokens), ()) for _ in range(num_turns - 1)]
        conversations.append(Conversation(index, tuple(turns), arrival))
    return Workload(tuple(conversations), spec.num_requests, len(pool.images), pool.num_repeats,
                    _warmup(spec, prompts, clips), len(clips.videos) if clips else 0,
                    clips.num_repeats if clips else 0)


def _warmup(spec: WorkloadSpec, prompts: PromptMaker, clips: _ClipPool | None) -> tuple[Turn, ...]:
    rng = random.Random(f"{spec.seed}:warmup")
    size = spec.image_sizes[0] if spec.image_sizes else None
    turns = []
    for _ in range(spec.num_warmup):
        # Seeds from 2**31 up: the run's images use getrandbits(31), so none of these can repeat one.
        images = tuple(BenchImage(-1, size.width, size.height,
                                  make_image(size.width, size.height, 2**31 + rng.getrandbits(31)))
                       for _ in range(spec.images_per_request))
        videos = tuple(clips.make(-1, 2**31 + rng.getrandbits(31)) for _ in range(spec.videos_per_request)) \
            if clips else ()
        turns.append(Turn(prompts.make(rng, spec.prompt_tokens), images, videos))
    return tuple(turns)
