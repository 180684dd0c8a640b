package clusterapi

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/netlog/release"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/spare"
	"github.com/ftkit/ftkit/tcpflow"
)

// The request and reply of every operation. The failure timelines and recovery stages belong to the
// agent's failure log: they travel as JSON the agent decodes and bounds itself (the body limit bounds them
// here).

// PingReply is the answer to OpPing.
type PingReply struct {
	Node string   `json:"node"`
	Jobs []string `json:"jobs"` // ids of the jobs running there
	// JobAddrs are the job addresses of the jobs running there (docs/job-addresses.md): who holds a job
	// address is not in the view, it moves with the job. The receiver validates them before use.
	JobAddrs []netip.Addr `json:"job_addrs,omitempty"`
	// JobPool is the member's job_network.pool (zero: none), so that overlapping pools are found.
	JobPool netip.Prefix `json:"job_pool,omitzero"`
	// MemAvailable is the member's available memory in bytes (MemAvailable in /proc/meminfo), which a
	// migration's source compares with the job's size before it stops the job. Nil: not reported (an agent
	// before this field, or one that could not read it); the receiver checks it is not negative.
	MemAvailable *int64 `json:"mem_available,omitempty"`
}

// FetchRequest asks for a snapshot the server holds (OpFetch).
type FetchRequest struct {
	Job string `json:"job"`
	ID  string `json:"id"`
}

// LocateRequest asks which job a snapshot id belongs to (OpLocate).
type LocateRequest struct {
	ID string `json:"id"`
}

// LocateReply names the job of the snapshot ("" if the server holds none) and its owner when known.
type LocateReply struct {
	ID  string  `json:"id"`
	Job string  `json:"job"`
	UID *uint32 `json:"uid,omitempty"`
}

// TrimPoint tells a sender up to where a receiver's durable snapshot covers a connection.
type TrimPoint struct {
	// The flow seen from the sender's socket: Local is the sender (the peer of the snapshotted job),
	// Remote the snapshotted job's end.
	tcpflow.Tuple
	Seq uint32 `json:"seq"` // the receiver's rcv_nxt in the snapshot (inq_seq)
}

// MaxTrimPoints bounds one OpTrim request (about 130 bytes a point at most: well inside MaxMessage); a
// snapshot with more connections to one peer is announced in several.
const MaxTrimPoints = 4096

// TrimRequest is OpTrim's request.
type TrimRequest struct {
	Points []TrimPoint `json:"points"`
}

// Validate bounds the request.
func (r TrimRequest) Validate() error {
	if len(r.Points) > MaxTrimPoints {
		return fmt.Errorf("%d trim points, more than the %d one message may carry", len(r.Points), MaxTrimPoints)
	}
	return nil
}

// TrimReply counts the connections trimmed.
type TrimReply struct {
	Trimmed int `json:"trimmed"`
}

// MaxLoggedFlows bounds one OpLogged request, as MaxTrimPoints does a trim.
const MaxLoggedFlows = MaxTrimPoints

// LoggedRequest is OpLogged's request: connections of a job of the caller's that was just snapshotted,
// each seen from the server's socket (Local is the server's end: the sender of what the job receives).
type LoggedRequest struct {
	Flows []tcpflow.Tuple `json:"flows"`
}

// Validate bounds the request.
func (r LoggedRequest) Validate() error {
	if len(r.Flows) > MaxLoggedFlows {
		return fmt.Errorf("%d flows, more than the %d one message may carry", len(r.Flows), MaxLoggedFlows)
	}
	return nil
}

// LoggedReply names the flows of a LoggedRequest that the server does not log, so that no restore of the
// caller's job could be given what the server's end sent after the snapshot: the server's log knows
// nothing of them (their sending process is not a protected one), or the server's sender-side log is off
// (LogOff: then all of them). Flows whose other end the caller does not hold are left out.
type LoggedReply struct {
	Unlogged []tcpflow.Tuple `json:"unlogged,omitempty"`
	LogOff   bool            `json:"log_off,omitempty"`
	// StateLost are the flows of Unlogged whose sending socket is a protected process's all the same:
	// nothing in the log, and the capture no longer holds their live state (it keeps the most recently
	// active protected flows only). The restore needs that state as it needs the bytes; only the reason
	// differs. An agent older than the field sends none: its flows are then all told as unprotected.
	StateLost []tcpflow.Tuple `json:"state_lost,omitempty"`
}

// Check refuses a reply that names a flow req did not ask about, or one in StateLost not in Unlogged.
func (r LoggedReply) Check(req LoggedRequest) error {
	asked := make(map[tcpflow.Tuple]bool, len(req.Flows))
	for _, f := range req.Flows {
		asked[f] = true
	}
	unlogged := make(map[tcpflow.Tuple]bool, len(r.Unlogged))
	for _, f := range r.Unlogged {
		if !asked[f] {
			return fmt.Errorf("the peer names flow %s, which was not asked about", f)
		}
		unlogged[f] = true
	}
	for _, f := range r.StateLost {
		if !unlogged[f] {
			return fmt.Errorf("the peer says flow %s lost its live state, but does not name it unlogged", f)
		}
	}
	return nil
}

// LogRangeRequest asks a sender for the bytes it logged on a connection from a sequence number on.
type LogRangeRequest struct {
	tcpflow.Tuple        // the flow seen from the sender's socket: Local is the sender
	From          uint32 `json:"from"`
}

// LogRangeReply precedes the bytes in the response body (one JSON line): Len bytes starting at sequence
// From follow it. Live is the sender's current state of the connection (its snd_nxt, rcv_nxt, TSval/TSecr),
// for the restorer.
type LogRangeReply struct {
	From uint32                `json:"from"`
	Len  int64                 `json:"len"`
	Live *ebpfprobes.FlowState `json:"live,omitempty"`
	// LiveAge is how old Live was when the reply was written (the sender's own clock measured it).
	LiveAge time.Duration `json:"live_age_ns,omitempty"`
}

// MaxLogRange bounds one log range. The restorer injects the range into a restored socket's receive
// queue, which must end at the peer's snd_nxt: more than half the 32-bit sequence space past the
// snapshot's receive point is no distance TCP's sequence numbers (or netlog.UnwrapNear) can express.
const MaxLogRange = 1<<31 - 1

// Validate bounds the announced length.
func (r LogRangeReply) Validate() error {
	if r.Len < 0 || r.Len > MaxLogRange {
		return fmt.Errorf("the peer announces %d logged bytes: a range holds 0 to %d", r.Len, int64(MaxLogRange))
	}
	return nil
}

// ReadLogBytes reads the n bytes a LogRangeReply announces. n comes from the peer: it is checked against
// limit, and memory beyond the first logBytesUpFront grows only as bytes arrive (never past n), so a peer
// that announces more than it sends gets an error, not an allocation of up to limit.
func ReadLogBytes(r io.Reader, n, limit int64) ([]byte, error) {
	return readLogBytes(r, n, limit, logBytesUpFront)
}

// logBytesUpFront is how much of an announced range ReadLogBytes allocates before the bytes arrive. A
// recovery reads the tens of MB a busy peer logged since the snapshot: in steps doubling from a small first
// buffer, they cost twice their size in fresh memory, whose page faults alone took about 40 ms for 24 MB
// on a 2-vCPU KVM guest (ftbench lazy-restore).
const logBytesUpFront = 64 << 20

func readLogBytes(r io.Reader, n, limit, upFront int64) ([]byte, error) {
	if n < 0 || n > limit {
		return nil, fmt.Errorf("the peer announces %d logged bytes: a range holds 0 to %d", n, limit)
	}
	buf := make([]byte, 0, min(n, upFront))
	for int64(len(buf)) < n {
		if len(buf) == cap(buf) {
			nb := make([]byte, len(buf), min(n, 2*int64(cap(buf))))
			copy(nb, buf)
			buf = nb
		}
		k, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+k]
		if err == io.EOF && int64(len(buf)) < n {
			err = io.ErrUnexpectedEOF
		}
		if err != nil && int64(len(buf)) < n {
			return nil, fmt.Errorf("read %d logged bytes: got %d: %w", n, len(buf), err)
		}
	}
	return buf, nil
}

// ReceivedRequest asks a member for its record of what one of its sockets received on a flow from a
// sequence number on. The flow is named as the receive record names it, from the sender's side: Local is
// the remote sender, Remote the member's socket.
type ReceivedRequest struct {
	tcpflow.Tuple
	From uint32 `json:"from"`
}

// ReceivedReply carries the record.
type ReceivedReply struct {
	Received *recvdigest.Received `json:"received"`
}

// Check validates a record from the wire: well formed and of the connection asked about.
func (r ReceivedReply) Check(req ReceivedRequest) error {
	switch {
	case r.Received == nil:
		return fmt.Errorf("sent no record")
	case r.Received.Conn != req.Tuple:
		return fmt.Errorf("sent the record of %s, not of %s", r.Received.Conn, req.Tuple)
	}
	return r.Received.Validate()
}

// MaxWatermarkAddrs bounds the addresses of one LogWatermark.
const MaxWatermarkAddrs = 1024

// LogWatermark is a receiving node's answer to OpLogWatermark.
type LogWatermark struct {
	// Age: every restore of a job on the node starts from a snapshot taken no earlier than this long before
	// the answer (the node's own clock measured it; 0 when it runs no job).
	Age time.Duration `json:"age_ns"`
	// Held says a running job holds the watermark back: a snapshot there would advance it.
	Held bool `json:"held"`
	// Addrs are the node's addresses when it answered: the watermark covers only jobs reached there.
	Addrs []netip.Addr `json:"addrs"`
}

// Placed validates a watermark from node and places it on this host's clock, given when the question left:
// sent minus the age is never later than the watermark, whatever the two clocks say.
func (r LogWatermark) Placed(node string, sent time.Time) (release.Watermark, error) {
	switch {
	case r.Age < 0:
		return release.Watermark{}, fmt.Errorf("log watermark from %s: negative age %v", node, r.Age)
	case len(r.Addrs) > MaxWatermarkAddrs:
		return release.Watermark{}, fmt.Errorf("log watermark from %s lists %d addresses, more than %d", node, len(r.Addrs), MaxWatermarkAddrs)
	}
	w := release.Watermark{At: sent.Add(-r.Age), Held: r.Held, Addrs: make([]netip.Addr, 0, len(r.Addrs))}
	for _, ip := range r.Addrs {
		if !ip.IsValid() {
			return release.Watermark{}, fmt.Errorf("log watermark from %s: invalid address", node)
		}
		w.Addrs = append(w.Addrs, ip.Unmap())
	}
	return w, nil
}

// ProbeRequest asks a member whether it reaches member Name.
type ProbeRequest struct {
	Name string `json:"name"`
}

// ProbeReply is its answer.
type ProbeReply struct {
	Name      string `json:"name"`
	Reachable bool   `json:"reachable"`
}

// VouchRequest asks the caller's protector to vouch for it (OpVouch): Incarnation is the caller's member
// incarnation, which the protector's view must list alive.
type VouchRequest struct {
	Incarnation uint64 `json:"incarnation"`
}

// VouchReply is the answer: Member is true if the protector holds the caller alive and did not declare it
// failed, and will not on the silence before this answer; otherwise Why says what the protector knows.
type VouchReply struct {
	Member bool   `json:"member"`
	Why    string `json:"why,omitempty"`
}

// ViewMessage carries the membership view (ring.Encode) and the failure timelines (the agent's
// []*Failure), both ways.
type ViewMessage struct {
	View     []byte          `json:"view"`
	Failures json.RawMessage `json:"failures,omitempty"`
}

// ClaimReply accepts a claim (a refusal is an error).
type ClaimReply struct{}

// ReplicaRequest asks a member for its newest verified replica of a job taken on a node.
type ReplicaRequest struct {
	Job  string `json:"job"`
	Node string `json:"node"`
}

// MaxReplicaReply bounds a ReplicaReply: a manifest of up to ckpt.MaxManifestBytes (a job with thousands of
// connections has one past MaxMessage) and the spares of its run, bounded as a claim's.
const MaxReplicaReply = ckpt.MaxManifestBytes + MaxClaim

// ReplicaReply carries it.
type ReplicaReply struct {
	Manifest *ckpt.Manifest `json:"manifest"`
	// RunSpares are the spares of the job's run as the replica's job record names them (its placement):
	// where the coordinator claims a spare first. Empty for a job without one.
	RunSpares []string `json:"run_spares,omitempty"`
}

// ForgetRequest tells a member that holds replicas of one of the caller's jobs that the job ended (at
// Ended) more than checkpoint.keep_ended ago: the replicas of it the caller took before then may go.
type ForgetRequest struct {
	Job   string    `json:"job"`
	Ended time.Time `json:"ended"`
}

// Validate checks the job name before the server uses it in a path.
func (r ForgetRequest) Validate() error {
	if err := ckpt.ValidName(r.Job); err != nil {
		return fmt.Errorf("forget: job: %w", err)
	}
	if r.Ended.IsZero() {
		return errors.New("forget: no end time")
	}
	return nil
}

// ForgetReply says how many replicas the server deleted, and how many it kept (a coordinated cut names
// them, or the job runs on the server).
type ForgetReply struct {
	Deleted int `json:"deleted"`
	Kept    int `json:"kept,omitempty"`
}

// Check validates an answer from the wire: it names the snapshot the target will ask for, so it must be
// this job's, from node.
func (r ReplicaReply) Check(req ReplicaRequest) error {
	switch {
	case r.Manifest == nil:
		return fmt.Errorf("answered without a replica")
	case r.Manifest.Job != req.Job || r.Manifest.Node != req.Node:
		return fmt.Errorf("asked for a replica of job %s from %s, got %q of job %q from %q", req.Job, req.Node, r.Manifest.ID, r.Manifest.Job, r.Manifest.Node)
	}
	if _, err := ckpt.ParseID(r.Manifest.ID); err != nil {
		return fmt.Errorf("asked for a replica of job %s from %s, got %q: %w", req.Job, req.Node, r.Manifest.ID, err)
	}
	// The target claims a spare by the sizes of its files and fetches the id: a manifest its holder's store
	// would not take (negative or wrapping sizes, an id of another node's) is refused here too.
	if err := r.Manifest.Validate(); err != nil {
		return fmt.Errorf("replica %s of job %s from %s: %w", r.Manifest.ID, req.Job, req.Node, err)
	}
	if len(r.RunSpares) > spare.MaxRunSpares {
		return fmt.Errorf("replica %s names %d spares of its run, at most %d", r.Manifest.ID, len(r.RunSpares), spare.MaxRunSpares)
	}
	for _, name := range r.RunSpares {
		if err := clustertls.ValidateMemberName(name); err != nil {
			return fmt.Errorf("replica %s: a spare of its run: %w", r.Manifest.ID, err)
		}
	}
	return nil
}

// RecoverJob names one job of a failed node and the snapshots to restore it from.
type RecoverJob struct {
	Job      string `json:"job"`
	Snapshot string `json:"snapshot"`
	Source   string `json:"source,omitempty"` // the member holding it, if not the request's Source
	// Candidates are the replicas to try in order, newest first (Snapshot and Source are the first): when
	// a holder fails to serve one, the target takes the next.
	Candidates []Candidate `json:"candidates,omitempty"`
	// TakenFrom is set when the failed node was itself restoring the job, for the recovery of this
	// earlier failed node, when it failed: the job may come back from that node's snapshots too.
	TakenFrom string `json:"taken_from,omitempty"`
}

// Candidate is one replica of a job: its snapshot id and the member that holds it.
type Candidate struct {
	Snapshot string `json:"snapshot"`
	Source   string `json:"source,omitempty"` // "" for the request's Source
}

// MaxCandidates bounds the replicas a recovery request may list per job (one per member holding one).
const MaxCandidates = 64

// CandidateList is the list the target tries, from the request: the job's list, or its single snapshot.
func (rj RecoverJob) CandidateList(defaultSource string) ([]Candidate, error) {
	cs := rj.Candidates
	if len(cs) == 0 {
		cs = []Candidate{{Snapshot: rj.Snapshot, Source: rj.Source}}
	}
	if len(cs) > MaxCandidates {
		return nil, fmt.Errorf("job %s: %d candidate snapshots, at most %d accepted", rj.Job, len(cs), MaxCandidates)
	}
	out := make([]Candidate, 0, len(cs))
	for _, c := range cs {
		if _, err := ckpt.ParseID(c.Snapshot); err != nil {
			return nil, fmt.Errorf("job %s: candidate: %w", rj.Job, err)
		}
		if c.Source == "" {
			c.Source = defaultSource
		}
		out = append(out, c)
	}
	return out, nil
}

// RecoverRequest asks a host (a claimed spare, or the protector itself) to take over a failed node's jobs.
type RecoverRequest struct {
	Failure string       `json:"failure"`
	Failed  string       `json:"failed"`
	Addrs   []netip.Addr `json:"addrs"` // the failed node's host addresses, taken over by the target
	Jobs    []RecoverJob `json:"jobs"`
	Source  string       `json:"source"` // the member holding the replicas
	// Migration: not a failure but a planned move (`ftctl migrate`), asked by the node the jobs ran on
	// (Failed), which is alive and holds their snapshots.
	Migration bool `json:"migration,omitempty"`
}

// MaxRecoverRequest bounds a recovery request (the jobs of one node and their candidate snapshots).
const MaxRecoverRequest = 4 << 20

// MaxRecoverJobs bounds the jobs one recovery request names.
const MaxRecoverJobs = 1024

// Validate bounds the request.
func (r RecoverRequest) Validate() error {
	if len(r.Jobs) == 0 || len(r.Jobs) > MaxRecoverJobs {
		return fmt.Errorf("recovery request names %d jobs: 1 to %d", len(r.Jobs), MaxRecoverJobs)
	}
	return nil
}

// RecoverProgress is one line of a recovery's progress stream: a stage (the agent's Stage), the end (Done,
// with the recovery's error if it failed), or neither: a keepalive between stages that take minutes.
type RecoverProgress struct {
	Stage json.RawMessage `json:"stage,omitempty"`
	Done  bool            `json:"done,omitempty"`
	Error string          `json:"error,omitempty"`
}

// RecoveryStatusRequest asks the target of a recovery how it went, and which of the failure's jobs run
// there.
type RecoveryStatusRequest struct {
	Failure string   `json:"failure"`
	Jobs    []string `json:"jobs,omitempty"`
}

// MaxRecoveryStatusJobs bounds the job list of a status question.
const MaxRecoveryStatusJobs = 4096

// Validate bounds the request.
func (r RecoveryStatusRequest) Validate() error {
	if len(r.Jobs) > MaxRecoveryStatusJobs {
		return fmt.Errorf("status question about %d jobs, more than %d", len(r.Jobs), MaxRecoveryStatusJobs)
	}
	return nil
}

// RecoveryStatusReply is the target's answer: what it knows of the recovery (Known: it ran it for this
// caller) and which of the asked-about jobs run there.
type RecoveryStatusReply struct {
	Failure string          `json:"failure"`
	Known   bool            `json:"known,omitempty"`
	Done    bool            `json:"done,omitempty"`
	Resumed bool            `json:"resumed,omitempty"`
	Error   string          `json:"error,omitempty"`
	Stages  json.RawMessage `json:"stages,omitempty"`
	Running []string        `json:"running,omitempty"`
}

// GrantRequest asks a member to grant incarnation Incarnation of Job to Holder, a restore attempt on the
// asking member, or with Release to give it back.
type GrantRequest struct {
	Job         string `json:"job"`
	Incarnation uint64 `json:"incarnation"`
	Holder      string `json:"holder"`
	Release     bool   `json:"release,omitempty"`
}

// RejoinRequest asks a member to admit the caller, a member its view lists as failed, back as a spare
// under its next incarnation (ring.View.Rejoin). Incarnation is the one the caller failed as, so that a
// retried request never bumps it twice. The answer is the view (and failure timelines) after the rejoin.
type RejoinRequest struct {
	Incarnation uint64 `json:"incarnation"`
}

// GrantReply is the member's answer: granted (or given back), or the grant that stands in the way.
type GrantReply struct {
	Granted  bool          `json:"granted,omitempty"`
	Conflict *grant.Record `json:"conflict,omitempty"`
}
