"""A corrupted .npz: NumPy and `kda run` refuse the same file.

One byte flipped inside a stored member's data. NumPy's zipfile checks the member's CRC-32 ("Bad CRC-32
for file 'hidden_states.npy'"); `kda run --input` must refuse it as well, naming the member, and write
no output (before, it computed on the corrupted input and exited 0).
"""

import shutil
import subprocess
import zipfile

import numpy as np
import pytest
from kda_paths import BINARY, DUMPS


def flip_inside_member(src, dst, member):
    """Copies src to dst with one byte of `member`'s stored data flipped."""
    data = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as z:
        info = z.getinfo(member)
        assert info.compress_type == zipfile.ZIP_STORED
    # The data follows the local header: 30 bytes, the name, the extra field.
    h = info.header_offset
    name_len = int.from_bytes(data[h + 26 : h + 28], "little")
    extra_len = int.from_bytes(data[h + 28 : h + 30], "little")
    start = h + 30 + name_len + extra_len
    data[start + info.compress_size // 2] ^= 0x20
    dst.write_bytes(bytes(data))


def test_numpy_and_kda_run_refuse_a_flipped_byte(tmp_path):
    mini = DUMPS / "mini"
    bad = tmp_path / "T8.npz"
    flip_inside_member(mini / "T8.npz", bad, "hidden_states.npy")
    with pytest.raises(zipfile.BadZipFile, match="Bad CRC-32 for file 'hidden_states.npy'"):
        np.load(bad)["hidden_states"]

    out = tmp_path / "out" / "o.npz"
    out.parent.mkdir()
    r = subprocess.run(
        [str(BINARY), "run", "--model", str(mini), "--layer", "0", "--input", str(bad), "--output", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0, r.stdout
    assert f"{bad}:hidden_states.npy: Bad CRC-32" in r.stderr
    assert list(out.parent.iterdir()) == []

    # The intact file still runs.
    good = tmp_path / "good.npz"
    shutil.copy(mini / "T8.npz", good)
    r = subprocess.run(
        [str(BINARY), "run", "--model", str(mini), "--layer", "0", "--input", str(good), "--output", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(np.load(out).files) == ["conv_state", "out", "recurrent_state"]
