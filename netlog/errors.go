package netlog

import (
	"errors"
	"fmt"
)

var (
	// ErrHole means part of a requested range was never logged (or not yet: the consumer
	// may lag the sender). The *RangeError says which bytes.
	ErrHole = errors.New("range not logged")
	// ErrTrimmed means part of a requested range was garbage-collected by Trim, or lies
	// before the base set with SetBase. The *RangeError says which bytes.
	ErrTrimmed = errors.New("range garbage-collected")
	// ErrConflict means a segment carried bytes that differ from bytes already logged for
	// the same sequence numbers. The log keeps the first version; see *ConflictError.
	ErrConflict = errors.New("logged bytes conflict")
	// ErrAmbiguous means a wire sequence names two positions the log may hold: it holds more than 2^32
	// bytes of the connection, so which one a restorer means is unknowable (Bounds.Servable).
	ErrAmbiguous = errors.New("wire sequence ambiguous: the log spans more than 2^32 bytes of the connection")
	// ErrUnknownConn means the Log holds no store for the connection.
	ErrUnknownConn = errors.New("connection not in log")
	// ErrClosed means the Store or Log was closed.
	ErrClosed = errors.New("netlog closed")
	// ErrAnchored means SetBase was called on a store that already has a reference point.
	ErrAnchored = errors.New("store already anchored")
)

// RangeError names the absolute byte range [From, To) that could not be served.
// It matches ErrHole or ErrTrimmed with errors.Is.
type RangeError struct {
	Kind     error // ErrHole or ErrTrimmed
	From, To uint64
}

func (e *RangeError) Error() string {
	return fmt.Sprintf("%v: bytes [%d, %d) (wire seq %d..%d, %d bytes)", e.Kind, e.From, e.To, Wire(e.From), Wire(e.To), e.To-e.From)
}

func (e *RangeError) Unwrap() error { return e.Kind }

// ConflictError reports a segment whose bytes differ from those already logged. From and To
// bound the differing bytes (first differing byte to one past the last); SegFrom and SegTo
// are the absolute range the offending segment covered. Nothing of the segment was stored.
type ConflictError struct {
	From, To          uint64
	SegFrom, SegTo    uint64
	Existing, Offered byte // the first differing byte: as logged, and as offered
}

func (e *ConflictError) Error() string {
	return fmt.Sprintf("%v: segment [%d, %d) differs from the log in bytes [%d, %d) (first at wire seq %d: logged %#02x, offered %#02x); segment rejected, the log keeps the first version - check the probe for torn or reused buffers",
		ErrConflict, e.SegFrom, e.SegTo, e.From, e.To, Wire(e.From), e.Existing, e.Offered)
}

func (e *ConflictError) Unwrap() error { return ErrConflict }
