package recovery

import (
	"context"
	"io"
	"log/slog"
	"net/netip"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/tcpflow"
)

// Stage names of the target's part of a recovery, in the order it goes through them (the coordinator's
// "detected" and "spare claimed" come before).
const (
	StageFetched   = "snapshot fetched"
	StageRewritten = "images rewritten"
	StageRestored  = "restored"
	StageReplayed  = "replay done"
	StageProtected = "re-protected"
)

// Phases of a job, as Tracker records them for a resume.
const (
	PhaseRestoring = "restoring" // the network is prepared; CRIU may or may not have restored it
	PhaseRestored  = "restored"  // it runs; the replay is not verified yet
	PhaseReplayed  = "replayed"  // re-sent and verified; re-protection pending
)

// A Stage is one step of a recovery as Run reports it; Job is empty for a step of all jobs.
type Stage struct {
	Name, Job  string
	Start, End time.Time
	Detail     string
	Err        error
}

// Check is what the target needs to check one connection's re-sent bytes besides the snapshot: the
// peer's record of what it received, or why there is none. It is part of the agent's on-disk recovery
// record (hence the JSON tags).
type Check struct {
	Received *recvdigest.Received `json:"received,omitempty"`
	Missing  string               `json:"missing,omitempty"`
}

// A Job is one job on its way back.
type Job struct {
	ID string
	// Incarnation is the snapshot's incarnation as Snapshots.Fetch returns it, the claimed one after.
	Incarnation uint64
	Manifest    *ckpt.Manifest
	// Work is the working copy of the snapshot's images (Jobs.Restore consumes it); RunID is its restore
	// run id (restore.RunID), which names its network guard.
	Work, RunID string
	// Source is the member the snapshot came from; Holder is the restore attempt that claims the job's
	// incarnation, to give it back if the job never runs.
	Source, Holder string
	// Ran is the host the job last ran on from Manifest: the failed node (the snapshot's own, or a spare
	// that failed while restoring it from the snapshot); its receive order is the one to replay.
	Ran  string
	Plan restore.Plan
	// RestoredAt is when CRIU's restore returned: the replay is measured from there.
	RestoredAt time.Time
	// Checks are the peers' records of what they received, per connection (Local: the restored end).
	Checks map[tcpflow.Tuple]Check
	// Replayed are flows whose replay is complete, seen by this recovery or by a previous agent's (a
	// resume): not waited for again, their clamp released.
	Replayed []tcpflow.Tuple
	// Net is the job's own network (a job address, package jobnet), nil for a job restored on the host's
	// network: Run creates it, guards the job's connections and announces the job's address inside it.
	Net JobNetwork
	// BeforeRun, if set, is called by Jobs.Restore once the job's cgroup is recorded on this host and
	// before any of its processes runs (a gate replaying receive positions arms the first stops there);
	// an error fails the restore.
	BeforeRun func() error
	// stopKeeping ends Log.Keep once the re-sent bytes are checked.
	stopKeeping func()
	// gate replays the job's receive order after the restore (nil: its bytes are in the images, gateWhy
	// says why); gateDone reports its end.
	gate     *intercept.Gate
	gateWhy  string
	gateDone chan gateResult
	// peers is the live state of each connection's peer, as planned.
	peers map[tcpflow.Tuple]restore.Peer
	// finErr says why a peer's FIN could not be delivered after the restore (deliverFins): the job would
	// wait for it forever, so ReplayAndVerify fails it.
	finErr error
}

// Snapshots gives a job's snapshot to restore.
type Snapshots interface {
	// Fetch fetches candidate c of job (unless this host has it), verifies it, and lays out a working copy
	// of its images: a Job with ID, Incarnation (the snapshot's), Manifest, Work, RunID and Source set.
	Fetch(ctx context.Context, job string, c clusterapi.Candidate) (*Job, error)
}

// Peers asks the surviving peers of a job's connections.
type Peers interface {
	// Owner is the member that holds addr, "" if none does (asking the members, within ctx, about an address
	// no view holds).
	Owner(ctx context.Context, addr netip.Addr) string
	// LogRange is what owner logged of a connection since a sequence number, and its live state.
	LogRange(ctx context.Context, owner string, req clusterapi.LogRangeRequest) (clusterapi.LogRangeReply, []byte, error)
	// Received is owner's record of what it received on conn (Local: the restored end, the sender; Remote:
	// owner's socket) from sequence from on, checked to be of conn and well formed.
	Received(ctx context.Context, owner string, conn tcpflow.Tuple, from uint32) (*recvdigest.Received, error)
}

// Log is this host's sender-side log, which captures what the restored jobs re-send.
type Log interface {
	// Keep makes the bytes the plan's connections re-send stay readable until stop is called.
	Keep(p restore.Plan) (stop func())
	// WaitLogged waits (a little) until the log holds conn's bytes from wire sequence from up to end.
	WaitLogged(ctx context.Context, conn tcpflow.Tuple, from, end uint32)
	// ReadRange writes the n bytes the log holds of conn from wire sequence seq on to w.
	ReadRange(ctx context.Context, w io.Writer, conn tcpflow.Tuple, seq, n uint32) error
	// SentUpTo is how far a restored socket has sent on flow.
	SentUpTo(flow tcpflow.Tuple) (uint32, bool)
	// FinSentAt is the sequence number of the FIN a restored socket sent on flow; false if it sent none.
	FinSentAt(flow tcpflow.Tuple) (uint32, bool)
}

// Jobs runs the restored jobs and owns their incarnations.
type Jobs interface {
	// Claim claims incarnation n of j for j.Holder cluster-wide, or a later one, which it returns.
	Claim(ctx context.Context, j *Job, n uint64) (uint64, error)
	// GiveBack returns j's claimed incarnation: the job never ran.
	GiveBack(ctx context.Context, j *Job)
	// GiveBackUnlessStarted returns it unless the failed restore may have left processes (cause).
	GiveBackUnlessStarted(ctx context.Context, j *Job, cause error)
	// Restore restores j's images under a shim on this host; it consumes j.Work.
	Restore(ctx context.Context, j *Job) error
	// State is the job's state, and whether it runs.
	State(id string) (state string, running bool)
	// Kill stops a restored job that cannot continue.
	Kill(id string, why error)
	// RollsBack reports whether a job that cannot continue is set aside for its whole run's rollback
	// (auto mode): then its peers are left as they are, for the rollback to restore, never reset.
	RollsBack(id string) bool
	// NetLeft records that j's network, which a failed recovery made, could not be deleted (err): it may
	// still hold the job's address on the wire, so the address stays out of the pool and the network is
	// deleted again later, until a deletion succeeds.
	NetLeft(j *Job, err error)
	// Reprotect snapshots the jobs and ships the snapshot to this host's protector.
	Reprotect(ctx context.Context, ids []string) (string, error)
}

// Clamp is the ACK clamp, which holds a restored flow's peer ACKs down until its replay is done.
type Clamp interface {
	Clamp(flow tcpflow.Tuple, sndNxt uint32) error
	// Hold drops (on) or passes (off) the peer's payload segments on a clamped flow, all but injected ones.
	Hold(flow tcpflow.Tuple, on bool) error
	// Release unregisters flow and says how many peer ACKs it clamped.
	Release(flow tcpflow.Tuple) (clamped uint64)
	// PeerTSval is the highest TSval the clamp saw on the peer's own segments of flow, if any.
	PeerTSval(flow tcpflow.Tuple) (uint32, bool)
}

// Network is the host's network around CRIU's restore (HostNetwork; the restore package's mechanics).
type Network interface {
	// Guard drops the packets of conns and the connection requests to addrs until CRIU's restore of the
	// dump runID unlocks the network (restore.Guard).
	Guard(ctx context.Context, runID string, conns []ckpt.Conn, addrs []netip.Addr) error
	Unguard(ctx context.Context, runID string) error
	TakeOver(ip netip.Addr) error
	Release(ip netip.Addr)
	// SetInitCwnd raises the routes' initial windows until putBack (restore.SetInitCwnd).
	SetInitCwnd(segments int) (putBack func() error, err error)
	// LowerPathMTU lowers the routes' MTU until putBack (restore.LowerPathMTU); putBack may be non-nil
	// with an error, for the routes that were lowered.
	LowerPathMTU() (putBack func() error, err error)
	Announce(ctx context.Context, ip netip.Addr) error
	// ResetPeer sends conn's peer a TCP RST at seq (restore.ResetPeer), from this network.
	ResetPeer(conn tcpflow.Tuple, seq uint32) error
	// DeliverFromPeer delivers payload to conn's local socket as its peer's segments until the socket has
	// taken in every byte (restore.DeliverFromPeer: what lay beyond its window is injected again); base is
	// the socket's rcv_nxt when it was restored.
	DeliverFromPeer(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader, payload []byte, base uint32) error
	// DeliverFIN delivers conn's peer's FIN (at h.Seq) to its local socket (restore.DeliverFIN).
	DeliverFIN(ctx context.Context, conn tcpflow.Tuple, h restore.PeerHeader) error
}

// JobNetwork is a job's own network on this host: Network inside the job's namespace (TakeOver is never
// called: the namespace holds only the job's address), which Create makes with the job's address.
type JobNetwork interface {
	Network
	// Create makes the job's network here; idempotent.
	Create(ctx context.Context) error
	// Delete removes it, its address first (a restore that failed must not leave the address answering),
	// or what a failed Create left of it; a network that is not there is no error.
	Delete(ctx context.Context) error
	// Addr is the job's address, announced once the job is restored.
	Addr() netip.Addr
}

// Determinants gives a recovery the receive order of the jobs it restores (package intercept).
type Determinants interface {
	// Since is what m's job consumed after m was dumped, asked of source (the member m came from), when it
	// last ran from m on host ran (the failed node: m's own, or a spare restored from m that failed before
	// a snapshot of its own, whose record then holds the order: intercept.Store.SinceOn).
	Since(ctx context.Context, source string, m *ckpt.Manifest, ran string) ([]intercept.Det, error)
	// Watch delivers the job's receive calls on this host, and its threads' stops, from now until stop;
	// the channel is closed if some were lost.
	Watch(job string) (events <-chan intercept.Event, stop func())
	// Positions reports whether this host counts its jobs' readiness calls: a gate can then replay
	// receive positions (intercept.Gate.UsePositions).
	Positions() bool
	// Stopper stops the threads of job, restored here; nil without positions.
	Stopper(job string) intercept.Stopper
}

// Tracker keeps the recovery on disk as it goes, for an agent restarted mid-way to resume it.
type Tracker interface {
	// Persist records the jobs about to be restored, with their replays and what checking them needs.
	Persist(jobs []*Job)
	// SetPhase moves a job on; phase "" drops a job that failed.
	SetPhase(id, phase string, at time.Time)
}

// Deps are the agent's actions a recovery uses. Clamp is nil when the host runs no ACK clamp.
type Deps struct {
	Snapshots Snapshots
	Peers     Peers
	Log       Log
	Jobs      Jobs
	Clamp     Clamp
	Network   Network
	Tracker   Tracker
	// Determinants is nil when this host records no receive order: restored jobs read their sockets
	// with every byte there at once.
	Determinants  Determinants
	Logger        *slog.Logger
	ReplayTimeout time.Duration // failover.replay_timeout
	// ParallelJobs is how many jobs Run fetches, plans and restores at once (failover.parallel_restores;
	// 0: DefaultParallelJobs).
	ParallelJobs int
}
