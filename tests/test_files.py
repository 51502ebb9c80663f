"""deepmetric.files.text_start: text vs binary from a file's first bytes."""
from deepmetric.files import text_start


def test_text_start_reads_text_and_refuses_binary():
    assert text_start(b"\n  model:\n    name: resnet18\n") == "model:"
    assert text_start(b"   \n\t") == ""  # blanks are text, with no first line
    assert text_start(b"PK\x03\x04\x00\x00") is None  # a NUL byte: a zip, a torch checkpoint
    assert text_start(b"\x89PNG\r\n\x1a\n") is None  # not UTF-8
    # a first read cut inside a character is still text; an invalid byte before the end is not
    cut = ("\u00e9t\u00e9 " + "x" * 505 + "\u00e9").encode("utf-8")[:512]
    assert cut[-1:] == b"\xc3" and text_start(cut).startswith("\u00e9t\u00e9 xx")
    assert text_start(b"abc\xff" + b"d" * 20) is None
    # a short file was read whole: an invalid or unfinished character at its end is binary
    assert text_start(b"\x80\x02\x8a") is None and text_start(b"abcdefgh\xff") is None
    assert text_start(b"abcdefgh\xc3") is None and text_start(b"x" * 511 + b"\xff") is None


def test_a_text_file_cut_inside_a_character_is_named_as_text(tmp_path):
    """evaluate's describe_file read the first 512 bytes as a whole: a UTF-8 note whose 512th byte
    fell inside a character was called a binary file."""
    from deepmetric.evaluate.io import describe_file

    note = tmp_path / "emb.npz"
    note.write_text("r\u00e9sum\u00e9 " + "x" * 502 + "\u00e9\n", encoding="utf-8")
    assert describe_file(note).startswith("a text file (it starts with 'r\u00e9sum\u00e9 xxx")
    note.write_bytes(b"abc\x00def")
    assert describe_file(note).startswith("a binary file of another kind (it starts with bytes 61 62 63 00")
