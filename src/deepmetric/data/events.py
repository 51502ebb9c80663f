"""Video events for event recognition (two-head paper, Sec. 4.2).

An *event* is a labelled time span of a video (a file PyAV can decode, or a folder of frame
images).  The paper's protocol, which :class:`EventDataset` implements:

* frames are sampled at ``rate`` frames per second (paper: 3);
* events shorter than ``min_seconds`` (paper: 2 s) are dropped (``ds.dropped`` lists them);
* a training item is a random window of ``window`` consecutive sampled frames (paper: 6,
  i.e. 2 s at 3 fps); a test item is the centre window (``test_windows=1``) or, with
  :func:`predict_events`, ``test_windows`` evenly spaced windows whose softmax scores are
  averaged;
* the frames go through a transform, by default the stack of difference
  (:class:`deepmetric.data.transforms.StackOfDifferences`, ``build_transform("sod")``).

Timing: event ``[start, end)`` seconds gives ``n = floor((end - start) * rate)`` sampled
frames at times ``start + k / rate``; sampled frame ``k`` is the source frame
``floor((start + k / rate) * fps)`` (``fps`` = the video's or folder's frame rate).

Sources of events:

* :func:`load_event_csv` - a CSV with columns ``path,label,split`` and optional
  ``start,end`` (seconds) and ``fps`` (see docs/events.md);
* :func:`load_hdd_events` - per-frame label arrays in the layout of the public TRN code
  for HDD (``target/<session>.npy``; see docs/events.md for what this is based on);
* :mod:`deepmetric.data.synthetic_events` - rendered ego-motion clips (offline benchmark).
"""
from __future__ import annotations

import csv as _csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image
from .contract import MetricDatasetBase

from .decode import ImageDecodeError, decode_image
from .image_list import IMAGE_EXTENSIONS

__all__ = [
    "Event", "EventList", "EventDataset", "VideoDecodeError", "load_event_csv", "load_hdd_events",
    "events_from_frame_labels", "read_frames", "probe_source", "sampled_frame_indices",
    "window_starts", "predict_events", "HDD_CLASSES", "HDD_PAPER_CLASSES",
]

EVENT_SPLITS = ("train", "val", "test", "all")

_CSV_LAYOUT = """\
path,label,split,start,end,fps
videos/drive01.mp4,left_turn,train,12.0,16.5,
videos/drive01.mp4,straight,train,16.5,30.0,
frames/drive02/,stop,test,,,10
  (path: a video file or a folder of frame images, relative to the CSV's folder;
   start/end: seconds, empty = whole source; fps: the folder's frame rate, or empty)"""


class VideoDecodeError(RuntimeError):
    """A video or frame folder could not be read; the message names the file."""


@dataclass(frozen=True)
class Event:
    """One labelled span ``[start, end)`` (seconds) of ``source`` (video file or frame folder,
    whose frame rate is ``fps``).  ``origin`` says where it was listed (e.g. ``"a.csv:7"``)."""

    source: str
    label: int
    start: float
    end: float
    fps: float
    origin: str = ""
    num_frames: int | None = None  # frames in the source (clamps the last index)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class EventList:
    """Parsed events of one split, with a class mapping shared by every split."""

    events: list[Event]
    class_names: list[str]
    name: str = "events"
    split: str = ""
    dropped: list[tuple[Event, str]] = field(default_factory=list)

    @property
    def labels(self) -> np.ndarray:
        return np.asarray([e.label for e in self.events], dtype=np.int64)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.events)


# --------------------------------------------------------------------------- timing
def sampled_frame_indices(event: Event, rate: float) -> np.ndarray:
    """Source-frame index of every sampled frame: ``floor((start + k / rate) * fps)`` for
    ``k = 0 .. floor(duration * rate) - 1`` (clamped to the source's last frame)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive (frames per second), got {rate}")
    n = int(math.floor(event.duration * rate + 1e-9))
    t = event.start + np.arange(n) / rate
    idx = np.floor(t * event.fps + 1e-6).astype(np.int64)
    if event.num_frames is not None:
        idx = np.minimum(idx, event.num_frames - 1)
    return idx


def window_starts(num_sampled: int, window: int, count: int = 1) -> list[int]:
    """Deterministic test windows: ``count`` evenly spaced start positions in
    ``[0, num_sampled - window]`` (``count=1``: the centre window)."""
    last = num_sampled - window
    if last < 0:
        raise ValueError(f"an event with {num_sampled} sampled frames has no window of {window}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if count == 1:
        return [last // 2]
    return sorted({int(round(v)) for v in np.linspace(0, last, count)})


# --------------------------------------------------------------------------- reading
def _frame_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def _import_av():
    try:
        import av  # noqa: F401
    except ImportError as exc:  # pragma: no cover - av is in the dev extra
        raise VideoDecodeError(
            "reading video files needs PyAV: pip install 'deepmetric[video]' (or av==18.1.0); "
            "a folder of frame images works without it") from exc
    return av


def probe_source(path: str | os.PathLike) -> tuple[float | None, int]:
    """``(fps, number of frames)`` of a video file (fps from the stream) or a frame folder
    (fps ``None``: a folder has no rate of its own)."""
    p = Path(path)
    if p.is_dir():
        n = len(_frame_files(p))
        if n == 0:
            raise VideoDecodeError(f"{p}: frame folder holds no images ({', '.join(IMAGE_EXTENSIONS)})")
        return None, n
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such video file or frame folder")
    av = _import_av()
    try:
        with av.open(str(p)) as container:
            if not container.streams.video:
                raise VideoDecodeError(f"{p}: no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            n = int(stream.frames or 0)
            if n <= 0 or fps <= 0:  # container without counts: decode once
                n = sum(1 for _ in container.decode(stream))
                if fps <= 0 and container.duration:
                    fps = n / (container.duration / 1e6)
    except VideoDecodeError:
        raise
    except Exception as exc:  # av.error.* and friends
        raise VideoDecodeError(f"{p}: cannot read video ({type(exc).__name__}: {exc})") from exc
    if fps <= 0:
        raise VideoDecodeError(f"{p}: video has no frame rate; give the 'fps' column")
    return fps, n


def _read_after_seek(container, stream, needed: set[int], last: int) -> dict[int, Image.Image]:
    """Seek to the keyframe before the first needed frame and decode from there; a frame's
    index is ``round((pts - start) * time_base * fps)``.  Returns what it found (the caller
    falls back to decoding from the start when frames are missing, e.g. without timestamps)."""
    fps = float(stream.average_rate or 0)
    tb = stream.time_base
    if fps <= 0 or tb is None:
        return {}
    start = stream.start_time or 0
    first = min(needed)
    target = start + int(math.floor(first / fps / float(tb)))
    container.seek(target, stream=stream, backward=True, any_frame=False)
    got: dict[int, Image.Image] = {}
    for frame in container.decode(stream):
        if frame.pts is None:
            return {}
        i = int(round((frame.pts - start) * float(tb) * fps))
        if not got and i > first:  # the seek landed after the first wanted frame
            return {}
        if i in needed:
            got[i] = frame.to_image()
        if i >= last:
            break
    return got


def read_frames(path: str | os.PathLike, indices: Sequence[int], *, seek_after: int = 64) -> list[Image.Image]:
    """The source frames ``indices`` (any order, repeats allowed) of a video file or frame
    folder as PIL images.  Errors name the file.

    Videos: when the first wanted frame is at index ``seek_after`` or later, the reader seeks
    to the preceding keyframe (frame index from the timestamps) instead of decoding from the
    start; if that does not yield every wanted frame it decodes from the start."""
    p = Path(path)
    want = [int(i) for i in indices]
    if any(i < 0 for i in want):
        raise ValueError(f"{p}: negative frame index in {want}")
    if p.is_dir():
        files = _frame_files(p)
        out = []
        for i in want:
            if i >= len(files):
                raise VideoDecodeError(f"{p}: frame {i} requested but the folder has {len(files)} frames")
            try:
                out.append(decode_image(files[i], mode="RGB"))
            except (OSError, ImageDecodeError) as exc:
                raise VideoDecodeError(f"cannot read frame image: {exc}") from exc
        return out
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such video file or frame folder")
    av = _import_av()
    needed = set(want)
    got: dict[int, Image.Image] = {}
    last = max(want) if want else -1
    try:
        with av.open(str(p)) as container:
            stream = container.streams.video[0]
            if want and min(want) >= seek_after:
                got = _read_after_seek(container, stream, needed, last)
            if not needed <= set(got):  # no seek, or timestamps unusable: decode from the start
                got = {}
                container.seek(0)
                for i, frame in enumerate(container.decode(stream)):
                    if i in needed:
                        got[i] = frame.to_image()
                    if i >= last:
                        break
    except Exception as exc:
        raise VideoDecodeError(f"{p}: cannot decode video ({type(exc).__name__}: {exc})") from exc
    missing = sorted(needed - set(got))
    if missing:
        raise VideoDecodeError(f"{p}: frame {missing[0]} requested but the video decoded only {len(got) and max(got) + 1} frames")
    return [got[i] for i in want]


# --------------------------------------------------------------------------- CSV
def _float_or_none(text: str, where: str, column: str) -> float | None:
    if text == "":
        return None
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{where}: column '{column}' must be a number (seconds / frames per second), got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}: column '{column}' must be a non-negative number, got {text!r}")
    return v


def load_event_csv(path, split: str = "train", *, video_root=None, default_fps: float | None = None,
                   delimiter: str = ",") -> EventList:
    """Events of ``split`` from a CSV (columns ``path,label,split`` + optional ``start,end,fps``).

    Labels may be names or integers; the class list is the sorted set over *all* rows (every
    split shares it, as classification needs).  Paths are relative to ``video_root`` (default:
    the CSV's folder).  A frame folder needs a frame rate: the row's ``fps`` or ``default_fps``.
    Sources are probed (frame count, rate) when the list is built, so missing or unreadable
    files fail early, naming the file and the CSV line.
    """
    if split not in EVENT_SPLITS:
        raise ValueError(f"events: unknown split {split!r}; choose one of {EVENT_SPLITS}")
    if path is None:
        raise ValueError(f"events: no CSV given; pass root=<path to the .csv>, a file like:\n{_CSV_LAYOUT}")
    f = Path(os.fspath(path)).expanduser()
    if not f.is_file():
        raise FileNotFoundError(f"events: CSV '{f}' not found. Expected a file like:\n{_CSV_LAYOUT}")
    base = Path(os.fspath(video_root)).expanduser() if video_root is not None else f.parent
    with open(f, encoding="utf-8-sig", newline="") as fh:
        rows = [(no + 1, [c.strip() for c in r]) for no, r in enumerate(_csv.reader(fh, delimiter=delimiter))]
    rows = [(no, r) for no, r in rows if r and any(r)]
    if not rows:
        raise ValueError(f"events: '{f}' is empty. Expected:\n{_CSV_LAYOUT}")
    (_, header), body = rows[0], rows[1:]
    header = [h.lower() for h in header]
    missing = [c for c in ("path", "label", "split") if c not in header]
    if missing:
        raise ValueError(f"events: {f}:1: missing column(s) {missing}; header is {header}. Expected:\n{_CSV_LAYOUT}")
    col = {h: i for i, h in enumerate(header)}

    def get(row, name):
        i = col.get(name)
        return row[i] if i is not None and i < len(row) else ""

    parsed = []
    for no, row in body:
        where = f"{f}:{no}"
        if len(row) < 3:
            raise ValueError(f"events: {where}: expected columns {header}, got {row}")
        s = get(row, "split").lower()
        if s not in ("train", "val", "test"):
            raise ValueError(f"events: {where}: split must be train, val or test, got {get(row, 'split')!r}")
        if not get(row, "path") or not get(row, "label"):
            raise ValueError(f"events: {where}: empty path or label")
        parsed.append((where, s, get(row, "path"), get(row, "label"),
                       _float_or_none(get(row, "start"), where, "start"),
                       _float_or_none(get(row, "end"), where, "end"),
                       _float_or_none(get(row, "fps"), where, "fps")))
    names = sorted({p[3] for p in parsed}, key=lambda v: (0, int(v), "") if v.lstrip("-").isdigit() else (1, 0, v))
    lookup = {n: i for i, n in enumerate(names)}
    events, probed = [], {}
    for where, s, rel, lab, start, end, fps in parsed:
        if split != "all" and s != split:
            continue
        src = Path(rel) if Path(rel).is_absolute() else base / rel
        if src not in probed:
            try:
                probed[src] = probe_source(src)
            except (FileNotFoundError, VideoDecodeError) as exc:
                raise type(exc)(f"events: {where}: {exc}") from exc
        native_fps, n = probed[src]
        rate = fps or native_fps or default_fps
        if rate is None:
            raise ValueError(f"events: {where}: '{src}' is a frame folder; give its frame rate in the "
                             f"'fps' column (or default_fps=...)")
        total = n / rate
        start = 0.0 if start is None else start
        end = total if end is None else end
        if end <= start:
            raise ValueError(f"events: {where}: end ({end}) must be after start ({start})")
        if end > total + 1e-6:
            raise ValueError(f"events: {where}: end {end:.3f} s is past the end of '{src}' ({n} frames at "
                             f"{rate:g} fps = {total:.3f} s)")
        events.append(Event(str(src), lookup[lab], float(start), float(end), float(rate), where, n))
    return EventList(events, [str(n) for n in names], name=f.name, split=split)


# --------------------------------------------------------------------------- HDD
#: Goal-oriented class order of the per-frame ``target`` arrays in the public TRN code's
#: HDD data description (``data/data_info.json`` of github.com/xumingze0308/TRN.pytorch).
HDD_CLASSES = ("background", "intersection passing", "left turn", "right turn", "left lane change",
               "right lane change", "left lane branch", "right lane branch", "crosswalk passing",
               "railroad passing", "merge", "U-turn")
#: The eleven classes of the two-head paper's Fig. 7 / Table 4 (no railroad passing).
HDD_PAPER_CLASSES = tuple(c for c in HDD_CLASSES if c != "railroad passing")


def events_from_frame_labels(labels: Sequence[int], fps: float) -> list[tuple[int, float, float]]:
    """Maximal runs of equal per-frame labels -> ``(label, start s, end s)``."""
    y = np.asarray(labels).reshape(-1)
    if y.size == 0:
        return []
    cut = np.flatnonzero(np.diff(y)) + 1
    starts = np.r_[0, cut]
    ends = np.r_[cut, y.size]
    return [(int(y[a]), a / fps, b / fps) for a, b in zip(starts, ends)]


def _frame_labels(tf: Path) -> np.ndarray:
    """A session's per-frame labels as int64: integer arrays, or float arrays of whole numbers
    (as TRN.pytorch casts them); anything else names the file and the first bad value."""
    y = np.load(tf, allow_pickle=False)
    if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise ValueError(f"hdd: '{tf}': expected a 1-D array of per-frame labels (integers, or floats "
                         f"with whole values), got {y.dtype} {y.shape}")
    if np.issubdtype(y.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(y) | (y != np.round(y)))
        if bad.size:
            raise ValueError(f"hdd: '{tf}': float labels must be whole numbers; frame {int(bad[0])} holds "
                             f"{float(y[bad[0]])!r}")
        y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= len(HDD_CLASSES)):
        raise ValueError(f"hdd: '{tf}': labels must lie in 0..{len(HDD_CLASSES) - 1}, got {y.min()}..{y.max()}")
    return y.astype(np.int64, copy=False)


def _lengths_agree(frames_s: float, labels_s: float, label_fps: float) -> bool:
    """Frames and labels cover the same time, within 1 % or 3 label frames (extraction rounds
    the last frames)."""
    return abs(frames_s - labels_s) <= max(3.0 / label_fps, 0.01 * labels_s)


def load_hdd_events(root, split: str = "train", *, label_fps: float = 3.0, frames: str = "camera",
                    classes: Sequence[str] = HDD_PAPER_CLASSES, sessions: Sequence[str] | None = None,
                    frame_fps: float | None = None) -> EventList:
    """HDD goal-oriented events from per-frame label arrays (layout of the public TRN code).

    Layout under ``root``::

        target/<session>.npy        per-frame labels at label_fps (3), order HDD_CLASSES
                                    (integers, or floats with whole values)
        camera/<session>/*.jpg      the session's frames, at label_fps unless frame_fps says
          or camera/<session>.mp4   the session's video (any rate; events are cut by time)
        <split>_sessions.txt        one session id per line (train / val / test)

    Events are the maximal runs of one label; labels not in ``classes`` (default: the paper's
    eleven, i.e. without railroad passing) are skipped.  ``sessions`` overrides the list file.

    Each session's frames must cover the time of its labels: a frame folder holding 10 times
    as many frames as there are labels (every frame of the 30 fps video, not one per label) is
    refused, naming the rate it implies, unless ``frame_fps`` gives the folder's rate; a video
    whose duration differs from the labels' is refused too (within 1 % or 3 label frames).
    """
    r = Path(os.fspath(root)).expanduser()
    if sessions is None:
        lst = r / f"{split}_sessions.txt"
        if not lst.is_file():
            raise FileNotFoundError(f"hdd: '{lst}' not found: list the {split} session ids one per line "
                                    f"(or pass sessions=[...])")
        sessions = [s.strip() for s in lst.read_text().splitlines() if s.strip() and not s.startswith("#")]
    unknown = [c for c in classes if c not in HDD_CLASSES]
    if unknown:
        raise ValueError(f"hdd: unknown class name(s) {unknown}; known: {HDD_CLASSES}")
    if frame_fps is not None and not float(frame_fps) > 0:
        raise ValueError(f"hdd: frame_fps must be a positive frame rate, got {frame_fps!r}")
    keep = {HDD_CLASSES.index(c): i for i, c in enumerate(classes)}
    events = []
    for s in sessions:
        tf = r / "target" / f"{s}.npy"
        if not tf.is_file():
            raise FileNotFoundError(f"hdd: session {s}: label file '{tf}' not found")
        y = _frame_labels(tf)
        folder, video = r / frames / s, r / frames / f"{s}.mp4"
        src = folder if folder.is_dir() else video
        fps, n = probe_source(src)
        labels_s = y.size / label_fps
        if fps is None:  # a frame folder: its rate is frame_fps, or the labels' rate
            fps = float(frame_fps or label_fps)
            if not _lengths_agree(n / fps, labels_s, label_fps):
                implied = n / labels_s if labels_s else float("inf")
                raise ValueError(
                    f"hdd: session {s}: frame folder '{src}' holds {n} frames but '{tf}' has {y.size} labels at "
                    f"{label_fps:g} fps ({labels_s:.1f} s): read at {fps:g} fps the frames would cover "
                    f"{n / fps:.1f} s; the folder's frames run at {implied:.3g} fps. Extract one frame per label "
                    f"(ffmpeg -i VIDEO -vf fps={label_fps:g} {src}/%06d.jpg) or give the folder's rate "
                    f"(data.options.frame_fps: {implied:.3g})")
        elif not _lengths_agree(n / fps, labels_s, label_fps):
            raise ValueError(f"hdd: session {s}: video '{src}' lasts {n / fps:.1f} s ({n} frames at {fps:g} fps) "
                             f"but '{tf}' has {y.size} labels at {label_fps:g} fps ({labels_s:.1f} s): another "
                             "session's video, or a video cut differently from its labels")
        for lab, a, b in events_from_frame_labels(y, label_fps):
            if lab in keep:
                events.append(Event(str(src), keep[lab], a, min(b, n / fps), fps, f"{tf}:{a:.2f}s", n))
    return EventList(events, list(classes), name="hdd", split=split)


# --------------------------------------------------------------------------- dataset
class EventDataset(MetricDatasetBase):
    """``ds[i] -> (transform(window frames), label)`` over an :class:`EventList`.

    Args:
        events: the parsed events (or a list of :class:`Event` with ``class_names``).
        transform: callable on the list of ``window`` frames (PIL images, or uint8 arrays for
            rendered sources); default :class:`~deepmetric.data.transforms.StackOfDifferences`.
        rate: sampled frames per second (paper: 3).
        window: consecutive sampled frames per item (paper: 6 -> a 5-channel SOD).
        min_seconds: events shorter than this are dropped (paper: 2); so are events with fewer
            than ``window`` sampled frames.  ``ds.dropped`` lists ``(event, reason)``.
        random_window: random window per access (training) or the centre one; default
            ``split == "train"``.
        test_windows: windows :func:`predict_events` averages over.
        reader: ``reader(source, indices) -> frames``; default :func:`read_frames`.
    """

    def __init__(self, events: EventList, transform: Callable | None = None, *, rate: float = 3.0,
                 window: int = 6, min_seconds: float = 2.0, random_window: bool | None = None,
                 test_windows: int = 1, reader: Callable | None = None):
        if window < 2:
            raise ValueError(f"window must be >= 2 frames (a difference needs two), got {window}")
        if test_windows < 1:
            raise ValueError(f"test_windows must be >= 1, got {test_windows}")
        if transform is None:
            from .transforms import StackOfDifferences

            transform = StackOfDifferences()
        self.transform = transform
        self.rate, self.window, self.min_seconds = float(rate), int(window), float(min_seconds)
        self.test_windows = int(test_windows)
        self.random_window = (events.split == "train") if random_window is None else bool(random_window)
        self.reader = reader or read_frames
        self.class_names = list(events.class_names)
        self.num_classes = len(self.class_names)
        self.split = events.split
        self.dropped = list(events.dropped)
        self.events, self.frame_indices = [], []
        for e in events.events:
            idx = sampled_frame_indices(e, self.rate)
            if e.duration < self.min_seconds - 1e-9:
                self.dropped.append((e, f"shorter than {self.min_seconds:g} s ({e.duration:.2f} s)"))
            elif len(idx) < self.window:
                self.dropped.append((e, f"{len(idx)} sampled frames < window {self.window}"))
            else:
                self.events.append(e)
                self.frame_indices.append(idx)
        self.labels = np.asarray([e.label for e in self.events], dtype=np.int64)
        if len(self.events) == 0:
            raise ValueError(f"events ({events.name}, split {events.split!r}): no event is at least "
                             f"{self.min_seconds:g} s long with {self.window} frames at {self.rate:g} fps "
                             f"({len(self.dropped)} dropped)")

    def __len__(self) -> int:
        return len(self.events)

    def window_indices(self, i: int, start: int) -> np.ndarray:
        """Source-frame indices of the window of event ``i`` starting at sampled frame ``start``."""
        return self.frame_indices[i][start:start + self.window]

    def item(self, i: int, start: int):
        e = self.events[i]
        frames = self.reader(e.source, self.window_indices(i, start))
        return self.transform(frames), int(e.label)

    def __getitem__(self, i: int):
        n = len(self.frame_indices[i])
        if self.random_window:
            start = int(torch.randint(0, n - self.window + 1, ()))
        else:
            start = window_starts(n, self.window, 1)[0]
        return self.item(i, start)

    def test_items(self, i: int):
        """Every deterministic test window of event ``i`` (``test_windows`` evenly spaced)."""
        starts = window_starts(len(self.frame_indices[i]), self.window, self.test_windows)
        return [self.item(i, s) for s in starts]


@torch.no_grad()
def predict_events(model: torch.nn.Module, dataset: EventDataset, *, batch_size: int = 64,
                   device: str | torch.device = "cpu") -> dict[str, np.ndarray]:
    """Class scores per event: the softmax of the model's ``logits`` averaged over the
    event's ``dataset.test_windows`` windows.  Returns ``{"probs": [N, C], "labels": [N]}``."""
    device = torch.device(device)
    was = model.training
    model.eval()
    probs, labels, xs, owner = [], [], [], []

    def flush():
        if not xs:
            return
        out = model(torch.stack(xs).to(device))
        p = torch.softmax(out["logits"].float(), dim=1).cpu()
        for o, row in zip(owner, p):
            probs[o] = row if probs[o] is None else probs[o] + row
        xs.clear()
        owner.clear()

    try:
        counts = []
        for i in range(len(dataset)):
            items = dataset.test_items(i)
            probs.append(None)
            labels.append(items[0][1])
            counts.append(len(items))
            for x, _ in items:
                xs.append(torch.as_tensor(x))
                owner.append(i)
                if len(xs) >= batch_size:
                    flush()
        flush()
    finally:
        model.train(was)
    p = torch.stack(probs) / torch.tensor(counts, dtype=torch.float32)[:, None]
    return {"probs": p.numpy(), "labels": np.asarray(labels, dtype=np.int64)}
