"""Video events (two-head paper Sec. 4.2): stack of differences, frame sampling and windows,
CSV / frame-folder / video sources, HDD layout, synthetic benchmark, per-class accuracy."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from deepmetric.data import build_dataset, build_transform
from deepmetric.data.events import (Event, EventDataset, EventList, VideoDecodeError, events_from_frame_labels,
                                    load_event_csv, load_hdd_events, predict_events, probe_source, read_frames,
                                    sampled_frame_indices, window_starts)
from deepmetric.data.transforms import StackOfDifferences
from deepmetric.evaluate import format_per_class_table, per_class_accuracy
from events_data import synthetic_events_config


# --------------------------------------------------------------------------- SOD
def _luma(rgb):
    """ITU-R 601-2 luma as PIL computes it, written out by hand."""
    r, g, b = (rgb[..., i].astype(np.int64) for i in range(3))
    return (19595 * r + 38470 * g + 7471 * b + 32768) >> 16


def test_sod_matches_hand_computation():
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (4, 5, 3), dtype=np.uint8) for _ in range(6)]
    sod = StackOfDifferences(scale=1.0)(frames)
    assert sod.shape == (5, 4, 5) and sod.dtype == torch.float32
    gray = [_luma(f) for f in frames]
    for c in range(5):
        np.testing.assert_array_equal(sod[c].numpy(), gray[c + 1] - gray[c])
    # by hand for one pixel: (255, 0, 0) -> 76, (0, 255, 0) -> 150; 150 - 76 = 74
    red = np.zeros((1, 1, 3), np.uint8)
    red[..., 0] = 255
    green = np.zeros((1, 1, 3), np.uint8)
    green[..., 1] = 255
    assert StackOfDifferences(scale=1.0)([red, green]).item() == 74.0
    # the default scale 1/255 maps the extreme differences -255 / +255 to -1 / +1
    black, white = np.zeros((2, 2), np.uint8), np.full((2, 2), 255, np.uint8)
    out = build_transform("sod", train=False)([black, white, black])
    np.testing.assert_allclose(out[0].numpy(), 1.0)
    np.testing.assert_allclose(out[1].numpy(), -1.0)
    # PIL images and tensors give the same stack as arrays
    pil = [Image.fromarray(f) for f in frames]
    np.testing.assert_array_equal(StackOfDifferences(scale=1.0)(pil).numpy(), sod.numpy())
    tens = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)
    np.testing.assert_array_equal(StackOfDifferences(scale=1.0)(tens).numpy(), sod.numpy())


def test_sod_crop_is_shared_by_all_frames_and_rejects_bad_input():
    frames = [np.full((10, 10), 10 * i, np.uint8) + np.arange(10, dtype=np.uint8)[None] for i in range(6)]
    torch.manual_seed(0)
    out = StackOfDifferences(crop=4, train=True, scale=1.0)(frames)
    assert out.shape == (5, 4, 4)
    assert torch.all(out == 10)  # same crop position in every frame: only the frame offsets differ
    centre = StackOfDifferences(crop=4, scale=1.0)(frames)
    assert torch.all(centre == 10)
    with pytest.raises(TypeError, match="uint8"):
        StackOfDifferences()([np.zeros((2, 2), np.float32)] * 2)
    with pytest.raises(ValueError, match="differ in size"):
        StackOfDifferences()([np.zeros((2, 2), np.uint8), np.zeros((3, 2), np.uint8)])
    with pytest.raises(ValueError, match="two frames"):
        StackOfDifferences()([np.zeros((2, 2), np.uint8)])


# --------------------------------------------------------------------------- sampling
def test_sampled_frames_follow_the_rate():
    e = Event("v", 0, start=1.0, end=6.0, fps=30.0)
    idx = sampled_frame_indices(e, 3.0)
    assert len(idx) == 15  # 5 s at 3 fps
    np.testing.assert_array_equal(idx, 30 + 10 * np.arange(15))
    # a 25 fps source: frame floor((start + k / 3) * 25)
    e2 = Event("v", 0, start=0.0, end=2.0, fps=25.0, num_frames=50)
    np.testing.assert_array_equal(sampled_frame_indices(e2, 3.0), [math.floor(k / 3 * 25 + 1e-6) for k in range(6)])


def test_window_starts():
    assert window_starts(6, 6) == [0]
    assert window_starts(15, 6) == [4]
    assert window_starts(15, 6, 3) == [0, 4, 9]
    with pytest.raises(ValueError, match="no window"):
        window_starts(5, 6)


def _list(durations, fps=6.0, split="train"):
    return EventList([Event(f"src{i}", i % 2, 0.0, d, fps, f"row {i}", int(round(d * fps)))
                      for i, d in enumerate(durations)], ["a", "b"], split=split)


def _index_reader(source, indices):
    # frame k of any source has the constant value k: a window's SOD reveals which frames it read
    return [np.full((2, 2), int(k), np.uint8) for k in indices]


def test_short_events_are_dropped_and_windows_have_six_frames_two_seconds_apart():
    ds = EventDataset(_list([1.9, 2.0, 5.0, 1.0]), StackOfDifferences(scale=1.0), reader=_index_reader)
    assert len(ds) == 2 and [e.duration for e in ds.events] == [2.0, 5.0]
    assert sorted(round(e.duration, 2) for e, _ in ds.dropped) == [1.0, 1.9]
    assert all("shorter than 2 s" in why for _, why in ds.dropped)
    # 6 fps source, 3 fps sampling: consecutive sampled frames are 2 source frames apart
    torch.manual_seed(0)
    for _ in range(20):
        x, y = ds[1]
        assert x.shape == (5, 2, 2) and torch.all(x == 2) and y == 0
    assert len(ds.frame_indices[1]) == 15
    seen = set()
    # random windows cover every start 0..9 of the 15-frame event; the test window is the centre
    rec = []
    ds.reader = lambda s, idx: rec.append(list(idx)) or _index_reader(s, idx)
    torch.manual_seed(1)
    for _ in range(300):
        ds[1]
    for idx in rec:
        assert len(idx) == 6 and (idx[-1] - idx[0]) / 6.0 == pytest.approx(5 / 3)
        seen.add(idx[0] // 2)
    assert seen == set(range(10))
    ds.random_window = False
    rec.clear()
    ds[1]
    assert rec == [[8, 10, 12, 14, 16, 18]]  # centre start 4 -> source frames 8..18


def test_event_dataset_rejects_empty_and_bad_settings():
    with pytest.raises(ValueError, match="no event is at least 2 s"):
        EventDataset(_list([1.0, 1.5]), reader=_index_reader)
    with pytest.raises(ValueError, match="window"):
        EventDataset(_list([3.0]), window=1, reader=_index_reader)


# --------------------------------------------------------------------------- files
def _write_folder(folder, n, step=10):
    folder.mkdir(parents=True)
    for k in range(n):
        Image.fromarray(np.full((8, 8), (k * step) % 256, np.uint8)).save(folder / f"{k:05d}.png")


def _write_video(path, n, fps=6, value=lambda k: 20 * k, codec="ffv1", marker=False):
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height = 16, 16
        s.pix_fmt = "yuv444p" if codec == "ffv1" else "yuv420p"
        s.gop_size = 12
        for k in range(n):
            img = np.full((16, 16, 3), value(k) % 256, np.uint8)
            if marker:  # a white bar in column k % 16 identifies the frame
                img[:, k % 16] = 255
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def test_csv_of_frame_folders_and_videos(tmp_path):
    _write_folder(tmp_path / "clips" / "a", 24)      # 4 s at 6 fps
    _write_folder(tmp_path / "clips" / "b", 9)       # 1.5 s: dropped
    _write_video(tmp_path / "drive.mkv", 12)         # 2 s at 6 fps (lossless ffv1)
    (tmp_path / "events.csv").write_text(
        "path,label,split,start,end,fps\n"
        "clips/a,turn,train,,,6\n"
        "clips/b,stop,train,,,6\n"
        "drive.mkv,stop,test,0,2,\n"
        "clips/a,straight,test,1,3.5,6\n")
    train = build_dataset("events", root=str(tmp_path / "events.csv"), split="train",
                          transform=build_transform("sod", train=True, scale=1.0))
    assert train.class_names == ["stop", "straight", "turn"] and len(train) == 1 and len(train.dropped) == 1
    x, y = train[0]
    assert y == 2 and x.shape == (5, 8, 8) and torch.all(x == 20)  # every 2nd frame of 10-step ramp
    test = build_dataset("events", root=str(tmp_path / "events.csv"), split="test",
                         transform=build_transform("sod", train=False, scale=1.0))
    assert [e.label for e in test.events] == [0, 1]
    x, y = test[0]  # the video: 6 sampled frames 0, 2, .., 10 -> values 0, 40, .., 200
    assert y == 0 and torch.all(x == 40)
    ev = test.events[1]
    assert (ev.start, ev.end) == (1.0, 3.5)
    np.testing.assert_array_equal(test.frame_indices[1], 6 + 2 * np.arange(7))


def test_csv_errors_name_the_file_and_line(tmp_path):
    (tmp_path / "broken.mp4").write_bytes(b"this is not a video" * 20)
    (tmp_path / "e.csv").write_text("path,label,split\nbroken.mp4,x,train\n")
    with pytest.raises(VideoDecodeError, match=r"e\.csv:2.*broken\.mp4"):
        load_event_csv(tmp_path / "e.csv", "train")
    (tmp_path / "m.csv").write_text("path,label,split\nmissing.mp4,x,train\n")
    with pytest.raises(FileNotFoundError, match=r"m\.csv:2.*missing\.mp4"):
        load_event_csv(tmp_path / "m.csv", "train")
    _write_folder(tmp_path / "f", 12)
    (tmp_path / "nofps.csv").write_text("path,label,split\nf,x,train\n")
    with pytest.raises(ValueError, match="frame rate"):
        load_event_csv(tmp_path / "nofps.csv", "train")
    (tmp_path / "late.csv").write_text("path,label,split,end,fps\nf,x,train,3,6\n")
    with pytest.raises(ValueError, match=r"late\.csv:2.*past the end"):
        load_event_csv(tmp_path / "late.csv", "train")
    (tmp_path / "cols.csv").write_text("file,label\nf,x\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['path', 'split'\]"):
        load_event_csv(tmp_path / "cols.csv", "train")


def test_video_decoding_errors_name_the_file(tmp_path):
    bad = tmp_path / "corrupt_clip.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    with pytest.raises(VideoDecodeError, match="corrupt_clip.mp4"):
        probe_source(bad)
    with pytest.raises(VideoDecodeError, match="corrupt_clip.mp4"):
        read_frames(bad, [0])
    good = tmp_path / "short.mkv"
    _write_video(good, 5)
    assert probe_source(good) == (6.0, 5)
    with pytest.raises(VideoDecodeError, match=r"short\.mkv: frame 7"):
        read_frames(good, [1, 7])
    frames = read_frames(good, [4, 1, 1])
    assert [np.asarray(f)[0, 0, 0] for f in frames] == [80, 20, 20]


@pytest.mark.parametrize("codec", ["ffv1", "libx264"])
def test_video_seek_reads_the_same_frames_as_sequential_decoding(tmp_path, codec):
    av = pytest.importorskip("av")
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not available in this PyAV build")
    path = tmp_path / f"long_{codec}.mkv"
    _write_video(path, 120, fps=25, value=lambda k: 0, codec=codec, marker=True)
    want = [70, 71, 100, 119, 90]
    seeked = read_frames(path, want, seek_after=0)
    sequential = read_frames(path, want, seek_after=10**9)
    for a, b, k in zip(seeked, sequential, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(np.asarray(a)[8, :, 0].argmax()) == k % 16  # the marker of frame k


# --------------------------------------------------------------------------- HDD layout
def test_events_from_frame_labels():
    assert events_from_frame_labels([0, 0, 2, 2, 2, 0], 3.0) == [(0, 0.0, 2 / 3), (2, 2 / 3, 5 / 3), (0, 5 / 3, 2.0)]
    assert events_from_frame_labels([], 3.0) == []


def test_hdd_miniature_tree(tmp_path):
    # background 3 s, left turn 2 s, railroad passing 2 s (not one of the paper's 11 classes),
    # left lane change 1 s (too short), background 7 frames
    y = np.array([0] * 9 + [2] * 6 + [9] * 6 + [4] * 3 + [0] * 7, dtype=np.int64)
    (tmp_path / "target").mkdir()
    np.save(tmp_path / "target" / "201704101118.npy", y)
    _write_folder(tmp_path / "camera" / "201704101118", len(y), step=5)
    (tmp_path / "train_sessions.txt").write_text("201704101118\n")
    ev = load_hdd_events(tmp_path, "train")
    assert len(ev.class_names) == 11 and "railroad passing" not in ev.class_names
    got = [(ev.class_names[e.label], round(e.start, 3), round(e.end, 3)) for e in ev.events]
    assert got == [("background", 0.0, 3.0), ("left turn", 3.0, 5.0), ("left lane change", 7.0, 8.0),
                   ("background", 8.0, round(31 / 3, 3))]
    ds = build_dataset("hdd", root=str(tmp_path), split="train", transform=build_transform("sod", train=False, scale=1.0))
    assert [ds.class_names[e.label] for e in ds.events] == ["background", "left turn", "background"]
    x, label = ds[1]  # left turn: label frames 9..14, one frame per label at 3 fps
    assert ds.class_names[label] == "left turn" and torch.all(x == 5)
    with pytest.raises(FileNotFoundError, match="test_sessions.txt"):
        load_hdd_events(tmp_path, "test")


def _numbered_folder(folder, n):
    """Frame k of a folder: pixel (0, 0) = k % 256, pixel (0, 1) = k // 256."""
    folder.mkdir(parents=True)
    for k in range(n):
        a = np.zeros((4, 4), np.uint8)
        a[0, 0], a[0, 1] = k % 256, k // 256
        Image.fromarray(a).save(folder / f"{k:06d}.png")


def _frame_number(img) -> int:
    a = np.asarray(img)[..., 0]
    return int(a[0, 0]) + 256 * int(a[0, 1])


def test_hdd_folder_with_every_video_frame_is_refused_or_read_at_its_rate(tmp_path):
    """The defect of issue 20: labels at 3 fps, a folder with all 30 fps frames. A left turn on
    label frames 10-15 (3.33-5 s) must read source frames 100-150, not 10-15."""
    y = np.array([0] * 10 + [2] * 6 + [0] * 15, dtype=np.int64)  # 31 labels = 10.33 s
    (tmp_path / "target").mkdir()
    np.save(tmp_path / "target" / "s1.npy", y)
    _numbered_folder(tmp_path / "camera" / "s1", 10 * len(y))
    (tmp_path / "train_sessions.txt").write_text("s1\n")
    with pytest.raises(ValueError) as e:
        load_hdd_events(tmp_path, "train")
    msg = str(e.value)
    assert "holds 310 frames but" in msg and "has 31 labels at 3 fps" in msg and "run at 30 fps" in msg
    assert "ffmpeg -i VIDEO -vf fps=3" in msg and "data.options.frame_fps: 30" in msg
    ds = build_dataset("hdd", root=str(tmp_path), split="train", frame_fps=30, min_seconds=1.0, window=5,
                       random_window=False, transform=lambda frames: frames)
    turn = [i for i, ev in enumerate(ds.events) if ds.class_names[ev.label] == "left turn"]
    (i,) = turn
    assert list(ds.frame_indices[i]) == [100, 110, 120, 130, 140, 150]  # floor((10/3 + k/3) * 30)
    frames, _ = ds[i]  # the centre window of 5 of the 6 sampled frames
    assert [_frame_number(f) for f in frames] == [100, 110, 120, 130, 140]
    # a rate that does not fit the frames is refused too
    with pytest.raises(ValueError, match="run at 30 fps"):
        load_hdd_events(tmp_path, "train", frame_fps=10)
    with pytest.raises(ValueError, match="frame_fps must be a positive frame rate"):
        load_hdd_events(tmp_path, "train", frame_fps=0)
    # one frame per label (ffmpeg -vf fps=3), give or take the last frames: accepted
    (tmp_path / "camera" / "s1").rename(tmp_path / "all_frames")
    _numbered_folder(tmp_path / "camera" / "s1", len(y) - 2)
    ev = load_hdd_events(tmp_path, "train")
    assert [ev.class_names[e.label] for e in ev.events] == ["background", "left turn", "background"]


def test_hdd_float_labels_and_video_length(tmp_path):
    y = np.array([0] * 9 + [2] * 6 + [0] * 9)
    (tmp_path / "target").mkdir()
    _write_folder(tmp_path / "camera" / "s1", len(y))
    (tmp_path / "train_sessions.txt").write_text("s1\n")
    np.save(tmp_path / "target" / "s1.npy", y.astype(np.int64))
    ints = load_hdd_events(tmp_path, "train").events
    np.save(tmp_path / "target" / "s1.npy", y.astype(np.float32))  # TRN.pytorch casts float targets
    assert load_hdd_events(tmp_path, "train").events == ints
    bad = y.astype(np.float64)
    bad[12] = 2.5
    np.save(tmp_path / "target" / "s1.npy", bad)
    with pytest.raises(ValueError, match=r"s1\.npy': float labels must be whole numbers; frame 12 holds 2\.5"):
        load_hdd_events(tmp_path, "train")
    bad[12] = np.nan
    np.save(tmp_path / "target" / "s1.npy", bad)
    with pytest.raises(ValueError, match="frame 12 holds nan"):
        load_hdd_events(tmp_path, "train")
    np.save(tmp_path / "target" / "s1.npy", np.array(["a", "b"]))
    with pytest.raises(ValueError, match="expected a 1-D array of per-frame labels"):
        load_hdd_events(tmp_path, "train")
    # a video of another length than its labels (8 s of labels, 4 s of video at 6 fps)
    np.save(tmp_path / "target" / "s1.npy", y.astype(np.int64))
    import shutil

    shutil.rmtree(tmp_path / "camera" / "s1")
    _write_video(tmp_path / "camera" / "s1.mp4", 24, fps=6)
    with pytest.raises(ValueError, match=r"video '.*s1\.mp4' lasts 4\.0 s \(24 frames at 6 fps\) but .* \(8\.0 s\)"):
        load_hdd_events(tmp_path, "train")
    _write_video(tmp_path / "camera" / "s1.mp4", 48, fps=6)
    assert len(load_hdd_events(tmp_path, "train").events) == 3


# --------------------------------------------------------------------------- synthetic
def test_synthetic_events_deterministic_long_tailed_and_split():
    kw = dict(num_train=60, num_test=30, size=16)
    a = build_dataset("synthetic_events", split="train", random_window=False, **kw)
    b = build_dataset("synthetic_events", split="train", random_window=False, cache=True, **kw)
    for i in (0, 5):
        torch.testing.assert_close(a[i][0], b[i][0], rtol=0, atol=0)
    val = build_dataset("synthetic_events", split="val", **kw)
    assert not {e.source for e in val.events} & {e.source for e in a.events}
    counts = np.bincount(np.r_[a.labels, val.labels, [e.label for e, _ in a.dropped + val.dropped]], minlength=6)
    assert counts[0] == counts.max() and counts[0] >= 5 * counts[-1]  # long-tailed
    assert a.dropped and all("shorter than 2 s" in why for _, why in a.dropped)
    x, _ = a[0]
    assert x.shape == (5, 16, 16) and x.abs().max() <= 1.0
    other = build_dataset("synthetic_events", split="train", random_window=False, seed=1, **kw)
    assert not torch.equal(other[0][0], a[0][0])


@pytest.mark.filterwarnings("ignore:.*no same-label reference")
def test_synthetic_events_train_and_predict_end_to_end(tmp_path):
    from deepmetric.train import train
    from deepmetric.run.config_io import config_from_dict

    cfg = config_from_dict(synthetic_events_config(tmp_path))
    res = train(cfg)
    assert {"top1", "mean_per_class"} <= set(res.metrics)
    from deepmetric.run.embed import load_model_from_checkpoint

    model, *_ = load_model_from_checkpoint(tmp_path / "last.pt")
    ds = build_dataset("synthetic_events", split="test", num_train=40, num_test=20, size=16, test_windows=3)
    out = predict_events(model, ds, batch_size=4)
    assert out["probs"].shape == (len(ds), 6)
    np.testing.assert_allclose(out["probs"].sum(1), 1.0, rtol=1e-5)
    # the average over windows equals the mean of the per-window softmax computed one by one
    model.eval()
    with torch.no_grad():
        xs = [x for x, _ in ds.test_items(0)]
        manual = torch.softmax(model(torch.stack(xs))["logits"], 1).mean(0).numpy()
    np.testing.assert_allclose(out["probs"][0], manual, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- per-class accuracy
def test_per_class_accuracy_against_brute_force():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 5, 200)
    y[y == 3] = 4  # class 3 absent from the test labels
    logits = rng.normal(size=(200, 5)).astype(np.float32)
    logits[np.arange(200)[:120], y[:120]] += 3  # mostly right
    res = per_class_accuracy(logits, y, class_names=list("ABCDE"))
    pred = logits.argmax(1)
    accs = []
    for c in range(5):
        members = [i for i in range(200) if y[i] == c]
        right = sum(1 for i in members if pred[i] == c)
        row = res["classes"][c]
        assert (row["name"], row["count"], row["correct"]) == ("ABCDE"[c], len(members), right)
        if members:
            assert row["accuracy"] == pytest.approx(right / len(members))
            accs.append(right / len(members))
        else:
            assert math.isnan(row["accuracy"])
    assert res["macro"] == pytest.approx(sum(accs) / len(accs))
    assert res["micro"] == pytest.approx(sum(pred[i] == y[i] for i in range(200)) / 200)
    table = format_per_class_table({"softmax": res, "two-head": per_class_accuracy(pred, y, num_classes=5,
                                                                                    class_names=list("ABCDE"))})
    lines = table.splitlines()
    assert lines[0] == "| class | test count | softmax | two-head |"
    assert lines[2] == f"| A | {res['classes'][0]['count']} | {100 * res['classes'][0]['accuracy']:.2f} | " \
                       f"{100 * res['classes'][0]['accuracy']:.2f} |"
    assert "| D | 0 | n/a | n/a |" in lines
    assert lines[-2].startswith("| **macro accuracy** |") and f"{100 * res['macro']:.2f}" in lines[-2]
    assert lines[-1] == f"| **micro accuracy** | 200 | {100 * res['micro']:.2f} | {100 * res['micro']:.2f} |"
    with pytest.raises(ValueError, match="other classes"):
        format_per_class_table({"a": res, "b": per_class_accuracy(pred[:10], y[:10], num_classes=5)})
