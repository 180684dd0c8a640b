package clusterapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// Error is a refusal as it travels: the HTTP status and this JSON body, the same on every operation.
type Error struct {
	Op      Op     `json:"op"`
	Code    string `json:"code"` // one of the Code* constants
	Message string `json:"message"`
	// Peer and Status are filled in by the Client (the member that refused, the HTTP status).
	Peer   string `json:"-"`
	Status int    `json:"-"`
}

// Error codes and the HTTP status each travels with.
const (
	CodeBadRequest      = "bad-request"     // 400: the body is not the operation's request
	CodeUnauthenticated = "unauthenticated" // 403: no verified member certificate
	CodeUnknownOp       = "unknown-op"      // 404: no such operation
	CodeMethod          = "method"          // 405: operations are POSTs
	CodeTooLarge        = "too-large"       // 413: the body is longer than the operation allows
	CodeRefused         = "refused"         // 422: the server understood the request and refused it
	CodeUnavailable     = "unavailable"     // 503: the server cannot serve it now (shutting down)
	// CodeRetry (409): refused for a condition that passes by itself (a connection reached a frozen job's
	// listen queue during a cut's dump): the whole operation, asked again, may succeed.
	CodeRetry = "retry"
)

func statusOf(code string) int {
	switch code {
	case CodeBadRequest:
		return http.StatusBadRequest
	case CodeUnauthenticated:
		return http.StatusForbidden
	case CodeUnknownOp:
		return http.StatusNotFound
	case CodeMethod:
		return http.StatusMethodNotAllowed
	case CodeTooLarge:
		return http.StatusRequestEntityTooLarge
	case CodeUnavailable:
		return http.StatusServiceUnavailable
	case CodeRetry:
		return http.StatusConflict
	}
	return http.StatusUnprocessableEntity
}

func (e *Error) Error() string {
	who := e.Peer
	if who == "" {
		who = "the peer"
	}
	return fmt.Sprintf("%s refused by %s (%s): %s", e.Op, who, e.Code, e.Message)
}

// wire is e as a server sends it: its message cut so that its JSON fits what the client reads of a refusal
// body (readRefusal) or of a determinant stream's answer line, MaxHeader bytes. A longer refusal went out
// whole, and the client, unable to decode it, lost its code (a refusal to retry taken for one for good, a
// stream's refusal for a broken stream) and its message. The server's log has the whole message.
func (e *Error) wire() *Error {
	c := *e
	for n := len(e.Message); ; n = min(n/2, MaxHeader/2) {
		if n < len(e.Message) {
			c.Message = strings.ToValidUTF8(e.Message[:n], "") + "..."
		}
		if b, err := json.Marshal(&c); err != nil || len(b) < MaxHeader || n == 0 {
			return &c
		}
	}
}

// Refusal returns err's refusal if it is one (nil otherwise).
func Refusal(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return nil
}

// Retry reports whether err holds a refusal that asks for the operation again (CodeRetry), whichever of
// the errors it joins.
func Retry(err error) bool {
	if err == nil {
		return false
	}
	if e, ok := err.(*Error); ok && e.Code == CodeRetry {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return Retry(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if Retry(e) {
				return true
			}
		}
	}
	return false
}

// StreamError means a stream broke after the server accepted the request: the operation may have gone on
// on the server (a recovery does), unlike a refusal or a failed connection.
type StreamError struct {
	Op   Op
	Peer string
	Err  error
}

func (e *StreamError) Error() string {
	return fmt.Sprintf("%s stream from %s broke: %v", e.Op, e.Peer, e.Err)
}

func (e *StreamError) Unwrap() error { return e.Err }
