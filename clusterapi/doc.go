// Package clusterapi is the protocol between ftkit agents: HTTP/1.1 over the cluster's mutual TLS
// (internal/clustertls), one POST path per operation, one typed request and reply per operation, and a
// typed error body so that a refusal reads the same on every operation.
//
// The Server authenticates the calling member from its TLS certificate, bounds and strictly decodes every
// request body, and calls a Service (the agent implements it) with the peer's name and the typed request.
// The Client has one method per operation; every call has a deadline (the caller's context, within the
// operation's own bound).
//
// Streams keep their framing inside one HTTP exchange: heartbeats are JSON lines in a streaming request
// body; logged bytes and recovery progress are a flushed streaming response. A stream goes on as long as it
// moves and is dropped after the idle timeout of silence. Snapshot shipping and fetching (ckpt/ship) talk
// both ways on one connection, so they switch protocols (HTTP 101) and run on the connection itself.
//
// Operators (a cluster-wide ftctl with an operator certificate) have operations of their own, served by an
// OperatorService (operator.go); each kind of certificate is refused for the other kind's operations.
package clusterapi
