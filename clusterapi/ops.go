package clusterapi

import (
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/spare"
)

// Op names an operation between agents; its path is "/v1/" + the name.
type Op string

const (
	OpPing     Op = "ping"     // liveness and the peer's running jobs
	OpSnapshot Op = "snapshot" // the caller ships a snapshot to the server (its protector)
	OpFetch    Op = "fetch"    // the caller asks for a snapshot the server holds (to restore it)
	OpLocate   Op = "locate"   // which job does a snapshot id the server holds belong to
	// Sender-side log.
	OpTrim          Op = "trim"           // the caller's snapshot covers these receive points: drop older log data
	OpLogRange      Op = "log-range"      // bytes the server logged on a connection from a sequence number on
	OpCheckpointNow Op = "checkpoint-now" // the caller's log is under pressure: snapshot the server's jobs
	OpReceived      Op = "received"       // the server's record of what one of its sockets received
	OpLogWatermark  Op = "log-watermark"  // how old is the server's oldest restore point
	OpLogged        Op = "logged"         // which of these connections to the caller's job does the server log
	// Receive-order determinants (package intercept).
	OpDeterminants      Op = "determinants"       // the caller's job consumed its connections in this order (to its protector)
	OpDeterminantsSince Op = "determinants-since" // what a job consumed after a snapshot the server holds
	OpDeterminantStream Op = "determinant-stream" // OpDeterminants' batches one after another on one connection, each answered (detstream.go)
	// OpDeterminantStream2: the same batches, answered only when the caller asks or the server refuses one.
	OpDeterminantStream2 Op = "determinant-stream-2"
	// OpDeterminantStream3: as OpDeterminantStream2, each batch's packed determinants as raw bytes after its line.
	OpDeterminantStream3 Op = "determinant-stream-3"
	// Failure detection and recovery.
	OpHeartbeat      Op = "heartbeat"       // a stream of heartbeats from the server's predecessor in the ring
	OpProbe          Op = "probe"           // does the server reach a suspect's agent
	OpView           Op = "view"            // exchange membership views (and failure timelines)
	OpClaim          Op = "claim"           // claim this spare for a failed node
	OpRecover        Op = "recover"         // restore a failed node's jobs on the server
	OpReplica        Op = "replica"         // the newest verified replica of a job from a node the server holds
	OpForget         Op = "forget"          // the caller's job ended long ago: drop the replicas of it the caller took
	OpRecoveryStatus Op = "recovery-status" // how a recovery the server was the target of went
	OpGrant          Op = "grant"           // grant (or give back) the next incarnation of a job to a restore
	OpRejoin         Op = "rejoin"          // the caller, a failed member, asks to come back as a spare
	// OpVouch: the caller, back from a stall of its own that its fence timeout saw as isolation, asks its
	// protector whether it is still a member; yes binds the protector not to declare it failed on that silence.
	OpVouch Op = "vouch"
	// Runs.
	OpStartJob Op = "start-job" // start a protected job on the server for a caller of the asking member
	OpSignal   Op = "signal"    // signal the server's copy of a job that left the asking member (signal.go)
	// OpCoordinate: one phase of a coordinated snapshot of a run, or of its rollback (coordinate.go).
	OpCoordinate Op = "coordinate"
)

// Path is the operation's URL path.
func (op Op) Path() string { return "/v1/" + string(op) }

// Ops lists every operation.
func Ops() []Op {
	return []Op{OpPing, OpSnapshot, OpFetch, OpLocate, OpTrim, OpLogRange, OpCheckpointNow, OpReceived,
		OpLogWatermark, OpLogged, OpDeterminants, OpDeterminantsSince, OpDeterminantStream, OpDeterminantStream2, OpDeterminantStream3, OpHeartbeat, OpProbe, OpView, OpClaim, OpRecover, OpReplica, OpForget, OpRecoveryStatus, OpGrant, OpRejoin, OpVouch, OpStartJob, OpSignal, OpCoordinate}
}

// MaxHeader bounds a small request body; MaxMessage bounds the larger ones (trims), every reply but those
// that carry a view, a manifest or a dump's connections (MaxViewMessage, MaxReplicaReply, MaxDumpReply),
// and every line of a stream.
const (
	MaxHeader  = 4096
	MaxMessage = 1 << 20
	// MaxClaim bounds a claim: it may name every spare of the failed node's run (spare.MaxRunSpares
	// member names of at most 64 bytes, quoted, with commas), and a snapshot to prefetch for each job a
	// recovery request may name (spare.MaxPrefetch): counting only the spares, every spare refused the
	// claim of a node with many long-named jobs as too long, and they were restored in basic mode.
	MaxClaim = MaxHeader + spare.MaxRunSpares*(64+3) + spare.MaxPrefetch*maxPrefetchJSON
	// maxPrefetchJSON bounds one spare.Prefetch as JSON: a job's name, a snapshot id, a member's name.
	maxPrefetchJSON = len(`{"job":"","snapshot":"","source":""},`) + ckpt.MaxNameLen + ckpt.MaxIDLen + 64
	// MaxViewMessage bounds a view message (OpView's request and reply, OpRejoin's reply): the largest
	// view a member accepts (ring.MaxEncoded), which JSON carries in base64, next to failure timelines
	// that fill MaxMessage at most. Under MaxMessage a view of a few thousand members could be adopted
	// but never pushed: every member refused it as too long.
	MaxViewMessage = (ring.MaxEncoded+2)/3*4 + MaxMessage
)

// upgradeProto is the protocol a snapshot transfer switches to (ckpt/ship framing).
const upgradeProto = "ftkit-ship/1"

// Default deadlines. Every read and write of a request or a reply has a deadline, so a member that
// connects and stalls (or a network that silently drops it) never holds a goroutine or a connection.
const (
	// DefaultMessageTimeout bounds reading or writing one request or reply.
	DefaultMessageTimeout = 10 * time.Second
	// DefaultIdleTimeout bounds the silence inside a stream that may last long as a whole (logged bytes,
	// recovery progress): the stream goes on as long as it keeps moving.
	DefaultIdleTimeout = time.Minute
	// DefaultPerMiB is the time a large message may take per MiB beyond the message timeout: the slowest
	// link allowed for carries 1 MiB/s.
	DefaultPerMiB = time.Second
)

// Timeouts are the protocol's deadlines; a zero field takes its default (tests shorten them).
type Timeouts struct {
	Message time.Duration
	Idle    time.Duration
	PerMiB  time.Duration
}

// MessageTimeout is the bound of one request or reply.
func (t Timeouts) MessageTimeout() time.Duration {
	if t.Message > 0 {
		return t.Message
	}
	return DefaultMessageTimeout
}

// IdleTimeout is the longest silence inside a stream.
func (t Timeouts) IdleTimeout() time.Duration {
	if t.Idle > 0 {
		return t.Idle
	}
	return DefaultIdleTimeout
}

// LargeTimeout is the deadline of one message of up to limit bytes: the message timeout plus the time the
// slowest link allowed for takes to carry it.
func (t Timeouts) LargeTimeout(limit int) time.Duration {
	perMiB := t.PerMiB
	if perMiB <= 0 {
		perMiB = DefaultPerMiB
	}
	return t.MessageTimeout() + time.Duration(limit>>20)*perMiB
}
