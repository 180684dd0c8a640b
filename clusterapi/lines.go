package clusterapi

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// ErrTooLong means a peer sent a message longer than the operation allows.
var ErrTooLong = errors.New("message too long")

// ReadLine reads one JSON line of at most limit bytes (the newline excluded) from r into v, never holding
// more than limit bytes whatever the peer sends. It decodes strictly: one value, no unknown field.
func ReadLine(r *bufio.Reader, v any, limit int) error {
	var buf []byte
	for {
		chunk, err := r.ReadSlice('\n')
		if len(buf)+len(chunk) > limit+1 || (len(buf)+len(chunk) == limit+1 && !bytes.HasSuffix(chunk, []byte{'\n'})) {
			return fmt.Errorf("%w: a line longer than %d bytes", ErrTooLong, limit)
		}
		buf = append(buf, chunk...)
		switch {
		case err == nil:
			if err := decodeStrict(buf[:len(buf)-1], v); err != nil {
				return fmt.Errorf("message line of %d bytes is not the expected JSON: %w", len(buf)-1, err)
			}
			return nil
		case errors.Is(err, bufio.ErrBufferFull):
			continue
		case err == io.EOF && len(buf) > 0:
			err = io.ErrUnexpectedEOF // the stream ended inside the line
		}
		return fmt.Errorf("read message line: %w", err)
	}
}

// WriteLine writes v as one JSON line in a single write.
func WriteLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode message: %w", err)
	}
	if _, err := w.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("write message: %w", err)
	}
	return nil
}

// decodeStrict decodes exactly one JSON value with only known fields.
func decodeStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if _, err := d.Token(); err != io.EOF {
		return errors.New("more than one JSON value")
	}
	return nil
}
