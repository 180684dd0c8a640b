package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ackclamp"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/interval"
	"github.com/ftkit/ftkit/ckpt/outputs"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/stalemounts"
	"github.com/ftkit/ftkit/detect"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/intercept/record"
	"github.com/ftkit/ftkit/internal/autogroup"
	"github.com/ftkit/ftkit/internal/jobfs"
	"github.com/ftkit/ftkit/internal/liveness"
	"github.com/ftkit/ftkit/internal/netnsthread"
	"github.com/ftkit/ftkit/internal/rootpath"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/metrics"
	"github.com/ftkit/ftkit/shim"
	"github.com/ftkit/ftkit/spare"
)

// Agent protects the jobs of one host.
type Agent struct {
	cfg  Config
	log  *slog.Logger
	criu criu.Client
	// raise, if set (checkpoint.dump_nice), raises the agent's CPU priority until what it returns is
	// called: CRIU's dumps hold it (criu.Client.Raise), and so do the windows in which the agent keeps jobs
	// frozen (raised).
	raise func() (release func())
	self  string // this executable, run as `shim` for each job
	jobs  jobStore
	// routeEdits keeps a recovery's route changes until they are put back (routeedits.go).
	routeEdits *routeEdits

	store       *ckpt.Store // this host's snapshots and the replicas it keeps for the nodes it protects
	criuVersion criu.Version
	diffs       ship.DiffHistory // whether diffing each job's snapshots against a base pays, and its last one's index

	mu       sync.Mutex
	byID     map[string]*Job
	policies map[string]*interval.Policy // by job id ("" for the host in semi-coordinated mode)
	// replicaConns are the connections of each running job's replica, for the check of connections
	// opened since (newconns.go).
	replicaConns map[string]replicaConns
	changed      chan struct{} // closed and replaced whenever a job changes, for long-polling clients
	// reservedAddrs count the holds on job addresses that no running job's record shows: a job being
	// started, not yet in byID; an ended job's network until it is deleted, lingering or not (releaseEnded).
	// Counted: a job that ends before its StartJob returns holds its address both ways.
	reservedAddrs map[netip.Addr]int
	// leftHeld are the addresses of the job networks that could not be deleted, by name: each holds one
	// count of reservedAddrs until a deletion of the network succeeds (holdLeftAddr, releaseLeftAddr).
	leftHeld map[string]netip.Addr
	// endedHeld count, by job network name, the holds finish made on the addresses of ended jobs' networks
	// not given back yet (releaseEndedAddr): a restore of the job counts its earlier copy's as its own
	// (reserveRestoredAddr), and only while it is there.
	endedHeld map[string]int
	// starting counts each non-root uid's starts in progress (admit), not yet in byID.
	starting map[uint32]int
	// outputSpace is what the output journals of restores running at once take of the state directory.
	outputSpace outputs.Space
	// lingering are the networks of ended jobs that outlive them (releaseEnded).
	lingering lingerNets
	// nets stands in for package jobnet where its fields are set (tests).
	nets jobNetOps
	// stateLock holds state_dir for this agent while it runs (lockStateDir).
	stateLock *os.File
	// drainMove stands in for Migrate in a drain where set (tests).
	drainMove func(context.Context, MigrateRequest, uint32) (*Migration, error)
	// leftNetsMu serializes the updates of the record of the job networks that could not be deleted (leftnets.go).
	leftNetsMu sync.Mutex
	// leftRetryMu is held over a running agent's retry of a left job network (retryLeftNet), which a new
	// network of the same name waits for (claimJobNet).
	leftRetryMu sync.Mutex
	// restoring names, by job id, the restore of the job under way on this host (lockRestore).
	restoring map[string]string
	// ending holds, by job id, the end of a copy of the job whose release is under way (finish): it goes by the
	// job's id and its cgroup's and network's names, which a restore of the job here makes again, so
	// lockRestore waits for it (the channel is closed once it is done).
	ending map[string]chan struct{}

	ckptMu sync.Mutex // one checkpoint (or host-wide freeze) at a time

	netlog *logState              // nil when the sender-side log is disabled
	coord  coordinated.Holds[Job] // runs whose jobs this host holds frozen for a coordinated snapshot
	// uncommitted pins the snapshots of cuts thawed here and not yet committed (coordinated.Uncommitted).
	uncommitted coordinated.Uncommitted
	// unloggedSeen are the connections of this host's unprotected processes members asked about (serveLogged).
	unloggedSeen unloggedReports

	members  membership      // the cluster view: ring, spares, who holds which address
	jobAddrs jobAddrOwners   // who holds which job address (jobaddr_owners.go)
	fetching fetchCalls      // snapshot transfers to this host under way
	replays  replayingJobs   // restored jobs whose recovery replays their peers' bytes: not snapshotted meanwhile
	replicas replicaArrivals // when the newest replica of each job arrived, by node
	shipping shippingDumps   // dumps being shipped, not yet recorded as replicas
	received freshReceipts   // the snapshots received (and so verified) in the last freshFor
	declared declaredFailed  // the peers this host declared failed: their snapshots are refused until their fail-over ends
	targets  followedTargets // the hosts this agent follows a recovery on: a view declaring one failed ends the wait
	// clusterNet is the cluster network, looked up once (clusterPrefix).
	clusterNet struct {
		once   sync.Once
		prefix netip.Prefix
	}
	busy     busyOps          // the long operations in progress (checkpoint, restore), carried by heartbeats
	beatNow  chan struct{}    // a beat should not wait for the interval (a job's replica lacks connections, a long operation begins)
	beating  beatContact      // the heartbeat stream to the protector, whose acknowledgements the self-fence reads
	watchdog *detect.Watchdog // over this node's predecessor in the ring
	stalls   *detect.Stalls   // this agent's own scheduling delays (watchSelf)
	loops    *liveness.Loops  // whether the loops the ring depends on still turn (StaleLoops); set by Run
	serving  chan struct{}    // closed once Run serves
	failures *failurelog.Log  // timelines of the failures this agent knows of
	claims   *spare.Holder    // this host's claim state while it is a spare
	clamp    *ackclamp.Clamp  // ACK clock for restored sockets that re-send what peers have; nil if unavailable
	det      *record.Recorder // this host's jobs' receive-order determinants, recorded and shipped
	detStore *intercept.Store // the determinants of the jobs protected here
	// staleMounts remembers which mounts of each job's namespace are copies of host mounts (snapshot.go).
	staleMounts stalemounts.Tracker

	wire       wireTimeouts // deadlines of the agent-to-agent protocol; zero fields take the defaults
	peerClient peerClient   // the agent-to-agent protocol's client (a.peers())
	asked      atomic.Int32 // the snapshots peers asked for (clusterapi.OpCheckpointNow): askIdle, askRunning, askQueued
	predicted  atomic.Bool  // the health command predicts a failure of this host (health.go)
	// answering: the health command answered (exit 0 or 1) at one of its last healthMisses runs, so interval
	// auto counts only the failures it misses (unpredictedMTBF); false until its first answer.
	answering atomic.Bool
	// selfFenced: this host fenced itself and is still cut off from its ring neighbours (selfFence); it
	// starts and restores no job meanwhile, since its protector counts every copy here as gone.
	selfFenced atomic.Bool
	grants     *grant.Registry // the job incarnations this member granted (exactly one live incarnation)

	metrics *metrics.Metrics // served on metrics.listen; its recording methods accept nil
}

// New checks the host (root, CRIU 4.2 or newer, cgroup v2) and prepares the agent's directories.
func New(cfg Config, log *slog.Logger) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("ftagent must run as root (CRIU, eBPF, cgroups)")
	}
	bin, v, err := criu.Require(cfg.CRIU)
	if err != nil {
		return nil, err
	}
	if err := criu.CheckPatches(bin); err != nil {
		log.Warn("CRIU is usable but lacks a fix ftkit needs", "node", cfg.Name, "err", err)
	}
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("find own executable for job shims: %w", err)
	}
	a := &Agent{
		cfg: cfg, log: log.With("node", cfg.Name), criu: criu.Client{Binary: bin}, self: self,
		jobs:       jobStore{dir: filepath.Join(cfg.StateDir, "jobs")},
		routeEdits: openRouteEdits(filepath.Join(cfg.StateDir, routeEditsFile), log.With("node", cfg.Name)),
		byID:       map[string]*Job{}, policies: map[string]*interval.Policy{}, changed: make(chan struct{}),
		replicaConns:  map[string]replicaConns{},
		beatNow:       make(chan struct{}, 1),
		serving:       make(chan struct{}),
		reservedAddrs: map[netip.Addr]int{},
		criuVersion:   v,
	}
	if n := cfg.Checkpoint.DumpNice; n != 0 {
		a.raise = autogroup.NewRaiser(n, cfg.Heartbeat.Nice, a.log.With("setting", "checkpoint.dump_nice")).Hold
		a.criu.Raise = a.raise
	}
	a.metrics = metrics.New(metricsSource{a})
	if err := cfg.CheckJobNetwork(); err != nil {
		return nil, err
	}
	if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
		if err := cfg.CheckJobNameservers(b); err != nil {
			a.log.Warn("jobs on job addresses cannot reach every nameserver of /etc/resolv.conf: their lookups wait for timeouts or fail", "err", err)
		}
	}
	// The state directory is root's; jobs_dir and the socket's directory stay reachable by users.
	if err := prepareDirs(cfg, a.jobs.dir); err != nil {
		return nil, err
	}
	// Before anything here touches the jobs, networks, pins or records another agent on state_dir uses.
	if a.stateLock, err = lockStateDir(cfg.StateDir); err != nil {
		return nil, err
	}
	if yard, err := criu.NewCgroupYard(filepath.Join(cfg.StateDir, "criu-cgroup-yard"), a.log); err != nil {
		a.log.Warn("dumps run without a cgroup yard: CRIU mounts each cgroup hierarchy itself, inside the job's stop", "err", err)
	} else {
		a.criu.CgroupYard = yard
	}
	if err := os.MkdirAll(cfg.CgroupParent, 0o755); err != nil {
		return nil, fmt.Errorf("create %s: %w", cfg.CgroupParent, err)
	}
	if _, err := os.Stat(filepath.Join(cfg.CgroupParent, "cgroup.controllers")); err != nil {
		return nil, fmt.Errorf("cgroup_parent %s is not in a cgroup v2 hierarchy: %w", cfg.CgroupParent, err)
	}
	// Every host's /run/netns a mount point of its own before a job starts, as job networks make it: a job's
	// mount namespace, a copy of its host's, then holds that mount wherever it started, and every host that
	// may restore it has the directory to bind it from.
	if err := netnsthread.ShareRunDir(); err != nil {
		return nil, fmt.Errorf("prepare %s for network namespaces: %w", netnsthread.RunDir, err)
	}
	if err := a.loadView(); err != nil {
		return nil, err
	}
	if a.failures, err = failurelog.Open(cfg.StateDir, cfg.Name); err != nil {
		return nil, fmt.Errorf("failure timelines in %s: %w", cfg.StateDir, err)
	}
	if a.claims, err = spare.OpenHolder(filepath.Join(cfg.StateDir, "claim.json")); err != nil {
		return nil, err
	}
	if a.grants, err = grant.Open(filepath.Join(cfg.StateDir, "grants.json"), grant.Options{}); err != nil {
		return nil, err
	}
	a.openUncommitted() // before any snapshot: retention keeps what they pin
	a.watchdog = detect.NewWatchdog(watchdogConfig(cfg))
	a.stalls = detect.NewStalls(stallTick(cfg), stallLimit(cfg))
	a.store, err = ckpt.Open(filepath.Join(cfg.StateDir, "snapshots"), ckpt.Options{Node: cfg.Name, Logger: a.log})
	if err != nil {
		return nil, err
	}
	if cfg.Log.Enabled {
		if err := a.startLog(); err != nil {
			return nil, err
		}
	}
	a.detStore = intercept.NewStore(0, 0)
	a.det = record.New(record.Options{Logger: a.log, Record: cfg.Log.Enabled && cfg.Log.ReceiveOrder, Positions: cfg.Log.ReceivePositions,
		Pessimistic: cfg.Log.Pessimistic, CgroupParent: cfg.CgroupParent, RingBytes: cfg.Log.RingMiB << 20, ShipEvery: cfg.Log.ReceiveOrderShipEvery.Duration,
		Protector: a.detProtector, Peers: func() record.Peers { return a.peers() }, Metrics: a.metrics})
	if err := a.startAckClamp(); err != nil {
		// Recovery still works, with the whole re-sent gap in the initial congestion window.
		a.log.Warn("ACK clamp for restored sockets unavailable; large re-sent gaps may stall after a restore", "err", err)
	}
	a.log.Info("agent ready", "criu", bin, "criu_version", v.String())
	return a, nil
}

// notify wakes long-polling clients; call with a.mu held.
func (a *Agent) notify() {
	close(a.changed)
	a.changed = make(chan struct{})
}

// adopt loads the job records a previous agent left and finds out what became of each job.
// It returns how many running jobs it adopted.
func (a *Agent) adopt() (int, error) {
	jobs, err := a.jobs.all()
	n := 0
	for _, j := range jobs {
		if j.Node != a.cfg.Name {
			continue
		}
		a.byID[j.ID] = j
		if j.State == JobRunning && !a.ownCopyRuns(*j) {
			a.settleGone(j) // nothing of it runs here (a crashed host came back): never adopted
			continue
		}
		if j.State != JobRunning {
			if j.Net != nil { // a previous agent may have stopped while its closed connections lingered
				// One that cannot be deleted is recorded with its address, which stays held (deleteJobNet).
				a.removeOrphanJobNet(context.Background(), j.ID, j.netAddr(), "the job ended before this agent started")
			}
			if j.State == JobExited || j.State == JobLost {
				a.releaseLeftByEnd(j)
			}
			continue
		}
		a.thawLeftFrozen(j)
		a.checkAdoptedJobNet(j)
		a.protect(j)
		a.det.Watch(j.ID, j.Cgroup, false, "") // what it consumed while no agent ran is not recorded
		n++
		a.log.Info("adopted job", "job", j.ID, "pid", j.PID, "protected", j.Protected())
	}
	a.retryLeftNets(context.Background()) // knowing which jobs run here
	if err != nil {
		return n, fmt.Errorf("adopt jobs: %w", err)
	}
	return n, nil
}

// releaseLeftByEnd gives back what ended job j held here if a previous agent stopped between finish's save of
// its end and releaseEnded: its cgroup, a lazy restore's images (the job's memory) stayed for good. A cgroup
// something runs in is left: where hosts share a kernel (the lab), it is a copy's restored on another.
func (a *Agent) releaseLeftByEnd(j *Job) {
	own := a.layout().cgroup(j.ID)
	if _, err := os.Lstat(own); err != nil && j.LazyWork == "" {
		return // nothing left: the usual case
	}
	if populated(own) {
		return
	}
	a.log.Warn("giving back what a job that ended before this agent started still held here (the previous agent stopped as it ended)",
		"job", j.ID, "state", j.State, "cgroup", j.Cgroup, "lazy_work", j.LazyWork)
	a.releaseResources(j)
}

// thawLeftFrozen thaws a job's cgroup if it is frozen. Only the agent freezes job cgroups, and only for
// the length of a semi-coordinated snapshot: a frozen one at start was left by an agent that died during
// that snapshot, and its job would stay stopped forever.
func (a *Agent) thawLeftFrozen(j *Job) {
	frozen, err := isFrozen(j.Cgroup)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) { // no cgroup: the job is gone, which watchJobs finds out
			a.log.Warn("cannot read the freeze state of an adopted job's cgroup", "job", j.ID, "cgroup", j.Cgroup, "err", err)
		}
		return
	}
	if !frozen {
		return
	}
	if err := setFrozen(j.Cgroup, false); err != nil {
		a.log.Error("adopted job is frozen and cannot be thawed: it stays stopped until cgroup.freeze is set to 0",
			"job", j.ID, "cgroup", j.Cgroup, "err", err)
		return
	}
	a.log.Warn("adopted job was left frozen by an agent that stopped during a semi-coordinated snapshot; thawed",
		"job", j.ID, "cgroup", j.Cgroup)
}

// renewReceiverSnapshots asks every other node to snapshot now. A restarted agent has lost the log of what
// its adopted jobs sent before the restart; once the receivers' snapshots cover those bytes, no recovery
// needs them.
func (a *Agent) renewReceiverSnapshots(ctx context.Context) {
	a.log.Warn("agent restarted with running jobs: the log of what they sent before is gone; asking every node to snapshot now")
	for _, name := range a.otherMembers() {
		a.requestSnapshot(ctx, name)
	}
}

// otherMembers names every member of the ring but this node.
func (a *Agent) otherMembers() []string {
	var names []string
	for _, mb := range a.View().Ring() {
		if mb.Name != a.cfg.Name {
			names = append(names, mb.Name)
		}
	}
	return names
}

// StartJob creates a job and starts its program under a shim.
func (a *Agent) StartJob(ctx context.Context, spec JobSpec, uid, gid uint32) (*Job, error) {
	// Every caller's spec, a local one's too, gets the bounds of a member's start-job request (clusterapi:
	// a program, sizes, the working directory, run name, placement): its record travels with every
	// snapshot, and a peer restores it.
	if err := startRequest(spec, uid, gid).Validate(); err != nil {
		return nil, err
	}
	if err := a.refuseWhileFenced(); err != nil {
		return nil, err
	}
	release, err := a.admit(uid)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := a.cfg.CheckJobInterval(spec.Interval); err != nil {
		return nil, err
	}
	if err := spec.checkRecovery(); err != nil {
		return nil, err
	}
	if spec.Name == "" {
		spec.Name = defaultJobName(spec.Argv)
	}
	id, err := newJobID(spec.Name)
	if err != nil {
		return nil, err
	}
	if spec.Dir == "" {
		spec.Dir = "/"
	}
	l := a.layout()
	j := &Job{
		ID: id, Spec: spec, UID: uid, GID: gid, Node: a.cfg.Name, State: JobRunning,
		Created: time.Now().UTC(), Cgroup: l.cgroup(id), Dir: l.dir(id),
	}
	if spec.JobAddress {
		addr, err := a.allocJobAddr()
		if err != nil {
			return nil, err
		}
		// In byID (or not started) once StartJob returns. A network of a job that did not start that could
		// not be deleted keeps the address held by its name (deleteJobNet) until it is.
		defer a.releaseJobAddr(addr.Addr())
		j.Net = &JobNet{Name: jobNetName(a.cfg.Name, id), Kind: a.cfg.JobNetwork.Kind, Addr: addr}
	}
	// Root keeps the job directory (0755): were it the user's, the user could plant links there for the
	// shim, the snapshots and the restores, all root, to write through. The shim hands the user its outputs.
	jobs, err := jobfs.OpenTrusted(l.jobsDir)
	if err != nil {
		return nil, fmt.Errorf("open jobs_dir: %w", err)
	}
	d, err := jobs.Mkdir(id, 0o755)
	jobs.Close()
	if err != nil {
		return nil, fmt.Errorf("create job directory: %w", err)
	}
	d.Close()
	if err := os.Mkdir(j.Cgroup, 0o755); err != nil {
		return nil, fmt.Errorf("create job cgroup: %w", err)
	}
	// The job's network exists before the job: the shim is started inside it, so the job's processes
	// see only its loopback and its interface.
	if j.Net != nil {
		if err := a.createJobNet(ctx, j.Net); err != nil {
			// What Create made of it goes before its address goes back to the pool (its namespace, perhaps
			// its interface with the address up). Not ctx, which may be why Create stopped.
			a.deleteJobNet(context.WithoutCancel(ctx), id, j.Net)
			os.Remove(j.Cgroup)
			return nil, err
		}
	}
	// Logged from its first byte: the cgroup is protected before the job can open a socket.
	a.protect(j)
	a.det.Watch(j.ID, j.Cgroup, true, "")
	var pid int
	err = inJobNet(j.Net, func() (err error) {
		superseded, refusal := a.copyMarks(id, j.Incarnation)
		pid, err = shim.Launch(ctx, a.self, shim.Spec{
			JobID: id, Mode: shim.ModeStart, Argv: spec.Argv, Env: spec.Env, Dir: spec.Dir, UID: uid, GID: gid, Limits: spec.Limits, Umask: spec.Umask,
			Stdout: j.StdoutPath(), Stderr: j.StderrPath(), Cgroup: j.Cgroup, ExitFile: j.ExitPath(), Node: a.cfg.Name,
			Superseded: superseded, Refusal: refusal, Incarnation: &j.Incarnation,
		}, a.shimLog(id))
		return err
	})
	if err != nil {
		// The shim may have started the job's init before its report failed to come (the client went away
		// and Launch killed the shim, or the shim died): the init, in a PID namespace of its own, outlives
		// the shim and would run the program in no record. Whatever runs in the job's cgroup goes with it.
		a.supersede(*j)
		if kerr := a.killCgroup(id); kerr != nil {
			a.log.Error("a job whose shim gave no report could not be killed: anything it started runs unwatched", "job", id, "err", kerr)
		}
		a.releaseResources(j) // the receive order's watch too: each one left held a slot of a bounded map
		// Not ctx, which has ended when the client went away: jobnet.Delete would leave the network, and
		// its address, given back when StartJob returns, on the wire.
		a.deleteJobNet(context.WithoutCancel(ctx), id, j.Net)
		return nil, err
	}
	j.PID = pid
	if err := a.jobs.save(j); err != nil {
		// The job runs, but no record holds it: nothing would watch, protect or end it, and its address
		// would be handed out again. It goes, as the caller is told.
		a.supersede(*j)
		if kerr := a.killCgroup(id); kerr != nil {
			a.log.Error("a job whose record could not be saved could not be killed either: it runs unwatched", "job", id, "pid", pid, "err", kerr)
		}
		a.releaseResources(j)
		a.deleteJobNet(context.WithoutCancel(ctx), id, j.Net)
		return nil, fmt.Errorf("record job %s: %w; the job was killed", id, err)
	}
	a.mu.Lock()
	a.byID[id] = j
	a.notify()
	a.mu.Unlock()
	if j.Net != nil {
		a.log.Info("job started", "job", id, "pid", pid, "argv", spec.Argv, "uid", uid, "job_address", j.Net.Addr, "job_network", j.Net.Name)
	} else {
		a.log.Info("job started", "job", id, "pid", pid, "argv", spec.Argv, "uid", uid)
	}
	return j, nil
}

// maxEndedJobsPerUser bounds the records of a non-root user's ended jobs a host keeps (checkpoint.keep_ended)
// before it refuses that user's starts. Ended jobs leave max_jobs_per_user free, and each record holds its
// spec (up to clusterapi.MaxStartJobBytes of arguments and environment) in the agent's memory and its state
// directory for a day at the default: a program that exits at once, started in a loop, would have root
// keep them without bound. Records whose snapshots are forgotten already (Forgotten: kept while the job's
// address may be in use) are not counted: they are few, and could keep their user out for good.
const maxEndedJobsPerUser = 1024

// admit takes one of uid's job slots on this host for a start (checkpoint.max_jobs_per_user), counting its
// running jobs and its starts in progress, and refuses uid's start while this host keeps the records of
// maxEndedJobsPerUser of its ended jobs; release gives the slot back once the job is in byID, or failed.
func (a *Agent) admit(uid uint32) (release func(), err error) {
	most := a.cfg.Checkpoint.MaxJobsPerUser
	if uid == 0 || most <= 0 {
		return func() {}, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	n, ended := a.starting[uid], 0
	for _, j := range a.byID {
		switch {
		case j.UID != uid:
		case j.State == JobRunning:
			n++
		case !j.Forgotten:
			ended++
		}
	}
	if n >= most {
		return nil, fmt.Errorf("uid %d already runs %d jobs on %s, the most checkpoint.max_jobs_per_user allows a user: wait for one to end, or ask the operator", uid, n, a.cfg.Name)
	}
	if ended >= maxEndedJobsPerUser {
		return nil, fmt.Errorf("%s keeps the records of %d ended jobs of uid %d (checkpoint.keep_ended), the most it keeps of a user: start fewer, longer jobs, wait for the oldest to be forgotten, or ask the operator", a.cfg.Name, ended, uid)
	}
	if a.starting == nil {
		a.starting = map[uint32]int{}
	}
	a.starting[uid]++
	return func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		if a.starting[uid]--; a.starting[uid] == 0 {
			delete(a.starting, uid)
		}
	}, nil
}

// checkAdoptedJobNet looks for a running adopted job's network: a job whose network is gone (the host
// rebooted, someone deleted it) runs without its address, which only a restore elsewhere brings back.
func (a *Agent) checkAdoptedJobNet(j *Job) {
	if j.Net == nil {
		return
	}
	ok, err := jobnet.Exists(j.Net.Name)
	switch {
	case err != nil:
		a.log.Warn("cannot check an adopted job's network", "job", j.ID, "net", j.Net.Name, "err", err)
	case !ok:
		a.log.Error("adopted job's network is gone: the job runs without its address", "job", j.ID, "net", j.Net.Name, "addr", j.Net.Addr)
	default:
		a.log.Info("adopted job's network found", "job", j.ID, "net", j.Net.Name, "addr", j.Net.Addr)
	}
}

func (a *Agent) shimLog(id string) string { return filepath.Join(a.jobs.dir, id+".shim.log") }

// supersededMark is the file that tells the shim of job id's copy of incarnation inc on this host that the
// copy's end is not the job's (shim.Spec.Superseded); beside the job records, where only root writes.
func (a *Agent) supersededMark(id string, inc uint64) string {
	return filepath.Join(a.jobs.dir, fmt.Sprintf("%s.%d.superseded", id, inc))
}

// refusalMark is the file that tells the same shim why the agent killed the copy (shim.Spec.Refusal).
func (a *Agent) refusalMark(id string, inc uint64) string {
	return filepath.Join(a.jobs.dir, fmt.Sprintf("%s.%d.refused", id, inc))
}

// copyMarks returns the marks of a copy of job id about to be launched here, for its shim.Spec, after
// removing those an earlier copy of the same incarnation left.
func (a *Agent) copyMarks(id string, inc uint64) (superseded, refusal string) {
	superseded, refusal = a.supersededMark(id, inc), a.refusalMark(id, inc)
	for _, p := range []string{superseded, refusal} {
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			a.log.Warn("could not remove an earlier copy's mark: this copy's end may be recorded wrong", "job", id, "mark", p, "err", err)
		}
	}
	return superseded, refusal
}

// writeMark writes one of a copy's marks (copyMarks), never through a link. The marks lie beside the job
// records, in jobs_dir in the default layout, which users may write to (sticky): a file there that is not
// root's was planted by a user, whose owner may change or remove it at will and which the shim does not
// believe; it is replaced by root's own. Root's own, once there, no user can replace.
func writeMark(path, content string) error {
	f, err := rootpath.OpenOwnFile(path, 0)
	if err != nil {
		return err
	}
	err = f.Truncate(0)
	if err == nil {
		_, err = f.WriteString(content)
	}
	return errors.Join(err, f.Close())
}

// supersede tells job j's shim that the copy it runs is not the job any more (it moved, was fenced, or
// runs elsewhere), before the caller kills it: the shim then writes no exit record, which ftwrap and the
// agents, following the job through its directory, would read as the job's end.
func (a *Agent) supersede(j Job) {
	if err := writeMark(a.supersededMark(j.ID, j.Incarnation), ""); err != nil {
		a.log.Warn("could not mark the job's copy superseded: its shim may record its kill as the job's end", "job", j.ID, "err", err)
	}
}

// Jobs returns copies of the jobs of this host that uid may see (every job for root).
func (a *Agent) Jobs(uid uint32) []Job {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []Job
	for _, j := range a.byID {
		if uid == 0 || j.UID == uid {
			out = append(out, *j)
		}
	}
	sortJobs(out)
	return out
}

// ErrNoJob means the job does not exist on this host, or the caller may not see it.
var ErrNoJob = errors.New("no such job")

// Job returns a copy of one job and a channel that is closed at its next change.
func (a *Agent) Job(id string, uid uint32) (Job, <-chan struct{}, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	j, ok := a.byID[id]
	if !ok || (uid != 0 && j.UID != uid) {
		return Job{}, nil, fmt.Errorf("%w: %s on %s", ErrNoJob, id, a.cfg.Name)
	}
	return *j, a.changed, nil
}

// watchJobs notices jobs that end: the shim writes the exit record; a job whose process is gone without
// one is lost (its shim was killed too).
func (a *Agent) watchJobs(ctx context.Context) {
	w := jobWatch{gone: map[string]time.Time{}, older: map[string]bool{}}
	tickgrid.Every(ctx, 200*time.Millisecond, func() { a.lookAtJobs(w) })
}

// jobWatch is what watchJobs keeps from one look at the running jobs to the next.
type jobWatch struct {
	gone  map[string]time.Time // when a job's process was first seen gone with no exit record
	older map[string]bool      // jobs whose older copy's record was warned of
}

// lookAtJobs is one look of watchJobs at the running jobs.
func (a *Agent) lookAtJobs(w jobWatch) {
	a.mu.Lock()
	var running []*Job
	listed := map[string]bool{}
	for _, j := range a.byID {
		if j.State == JobRunning {
			running = append(running, j)
			listed[j.ID] = true
		}
	}
	a.mu.Unlock()
	// What was seen of a copy that ended otherwise (moved, dropped as a failed host's) goes with it: a copy of
	// the job restored here later gets its own moment for its exit record, not a lost verdict from the old
	// copy's sighting.
	for id := range w.gone {
		if !listed[id] {
			delete(w.gone, id)
		}
	}
	for id := range w.older {
		if !listed[id] {
			delete(w.older, id)
		}
	}
	for _, j := range running {
		st, err := shim.ReadExit(j.ExitPath())
		if err == nil && st.Node != "" && st.Node != a.cfg.Name {
			// An older copy's record in the cluster-wide job directory (a fenced host marks its copy
			// superseded first, but a shim of an older agent records the kill): it says nothing about
			// the copy restored here.
			err = fs.ErrNotExist
		}
		if err == nil && st.Older(j.Incarnation) {
			// This host's own, of an older copy than the one it runs now (the job came back here): its
			// kill, recorded after the restore had set earlier records aside.
			if !w.older[j.ID] {
				w.older[j.ID] = true
				a.log.Warn("the job's directory holds the exit record of an older copy of the job, superseded, whose shim recorded its kill: not the end of the copy running here",
					"job", j.ID, "incarnation", j.Incarnation, "record_incarnation", *st.Incarnation, "node", st.Node, "code", st.Code)
			}
			err = fs.ErrNotExist
		}
		switch {
		case err == nil:
			a.finish(j, JobExited, st)
			delete(w.gone, j.ID)
			delete(w.older, j.ID)
		case !errors.Is(err, fs.ErrNotExist):
			a.log.Warn("unreadable exit record", "job", j.ID, "err", err)
		case !alive(j.PID):
			// The shim writes the record right after the job exits; give it a moment.
			if first, seen := w.gone[j.ID]; !seen {
				w.gone[j.ID] = time.Now()
			} else if time.Since(first) > 2*time.Second {
				a.finish(j, JobLost, nil)
				delete(w.gone, j.ID)
				delete(w.older, j.ID)
			}
		}
	}
}

func (a *Agent) finish(j *Job, state JobState, st *shim.ExitStatus) {
	a.mu.Lock()
	if a.byID[j.ID] != j || j.State != JobRunning {
		// The caller took j before a.mu was last free (a look of watchJobs, dropFailedJobs): the copy ended
		// another way meanwhile, and may have been restored here since under a new record. Ending it again
		// would save its old record over the new copy's and give back what that copy holds under the same names.
		a.mu.Unlock()
		return
	}
	j.State, j.Exit = state, st
	// Until what the copy held is given back, a restore of the job here waits (lockRestore): it would make the
	// cgroup, network and watches that this release removes by the job's id.
	ended := make(chan struct{})
	if a.ending == nil {
		a.ending = map[string]chan struct{}{}
	}
	a.ending[j.ID] = ended
	defer func() {
		a.mu.Lock()
		delete(a.ending, j.ID)
		a.mu.Unlock()
		close(ended)
	}()
	lingers := a.netLingers(j, state)
	reserved := j.Net != nil && !addressHeld(j)
	if reserved {
		// In the same step as the state that gives the address back (addressHeld): a job started by
		// someone who saw this one end must not get the address its network still holds, lingering or
		// not deleted yet (releaseEnded gives it back once the network is gone).
		a.reservedAddrs[j.Net.Addr.Addr()]++
		if a.endedHeld == nil {
			a.endedHeld = map[string]int{}
		}
		a.endedHeld[j.Net.Name]++
	}
	err := a.jobs.save(j)
	a.notify()
	a.mu.Unlock()
	if err != nil {
		a.log.Error("save job record", "job", j.ID, "err", err)
	}
	a.releaseEnded(j, lingers, reserved)
	if st != nil {
		a.log.Info("job ended", "job", j.ID, "code", st.Code, "signal", st.Signal, "reason", st.Reason)
	} else {
		a.log.Warn("job lost: its process is gone and left no exit record", "job", j.ID)
	}
}

// releaseJob gives back what job j held on this host once its processes are gone (it ended, or moved):
// its log and receive-tap attachments, its cgroup, a lazy restore's images, its job network.
func (a *Agent) releaseJob(j *Job) error {
	a.releaseResources(j)
	// The job's address leaves the wire with it (a job network lives on by its bind mount otherwise).
	return a.deleteJobNet(context.Background(), j.ID, j.Net)
}

// releaseResources gives back what releaseJob does but the job network.
func (a *Agent) releaseResources(j *Job) {
	a.unprotect(j)
	a.det.Unwatch(j.ID)
	a.diffs.Forget(j.ID)
	// Only this agent's own cgroup for the job: a record restored from an older agent's snapshot may name
	// any path.
	if want := a.layout().cgroup(j.ID); !validJobID(j.ID) || j.Cgroup != want {
		a.log.Warn("job record names a cgroup that is not this agent's for the job; not removing it", "job", j.ID, "cgroup", j.Cgroup, "want", want)
	} else if err := os.Remove(j.Cgroup); err != nil && !errors.Is(err, fs.ErrNotExist) {
		a.log.Warn("remove job cgroup", "job", j.ID, "err", err)
	}
	if j.LazyWork != "" && a.ownRestoreDir(j.LazyWork) {
		criu.RemoveWorkDir(j.LazyWork) // it ended before all its pages were in: they are not needed any more
	}
}

func alive(pid int) bool {
	return pid > 0 && unix.Kill(pid, 0) != unix.ESRCH
}

// Names of the loops StaleLoops watches.
const (
	loopBeats     = "heartbeats"
	loopWatchdog  = "predecessor watchdog"
	loopSelfFence = "self-fence"
)

// Serving is closed once Run serves: its APIs listen and its loops run (systemd's READY=1).
func (a *Agent) Serving() <-chan struct{} { return a.serving }

// StaleLoops lists the loops the ring depends on that have not turned within limit before now: a
// deadlocked agent, which must not tell systemd's watchdog that it is alive (cmd/ftagent). Nil before Run.
func (a *Agent) StaleLoops(now time.Time, limit time.Duration) []string {
	select {
	case <-a.serving:
		return a.loops.Stale(now, limit)
	default:
		return nil
	}
}

// LocalAPI starts the host's local API (package agentapi) over the agent. Run starts it once the jobs a
// previous agent left are adopted, and closes it when it returns.
type LocalAPI func(ctx context.Context, a *Agent) (io.Closer, error)

// Run adopts the jobs a previous agent left, then serves until ctx ends. Jobs keep running when the agent
// stops: their shims are independent processes.
func (a *Agent) Run(ctx context.Context, local LocalAPI) error {
	adopted, err := a.adopt()
	if err != nil {
		a.log.Error("some job records could not be read", "err", err)
	}
	a.settleOutputJournals() // knowing which jobs run here; before any restore, a resumed one included
	// Knowing which jobs run here, and before anything here claims again (a resumed migration, the API).
	a.giveBackOrphanClaims(ctx)
	// Before any recovery runs, a resumed one included: one that changes the routes again finds them as
	// they were.
	if err := a.routeEdits.putBackLeft(); err != nil {
		a.log.Error("could not put back the route changes a previous agent made for a restore: new connections over them start with a large burst", "err", err)
	}
	// Before any restore, a resumed one included: a new restore of the same snapshot makes a guard of the
	// same name, which this must not remove.
	a.removeLeftGuards(ctx)
	// Before any snapshot is scheduled: a job whose replay a previous agent left unverified is not dumped
	// until its resumed recovery has verified it.
	go a.resumeRecoveries(ctx, a.pendingRecoveries())
	a.resumeMigrations(ctx)   // the resumed ones run on
	a.closeLeftFailovers(ctx) // the followed ones run on
	srv, err := local(ctx, a)
	if err != nil {
		return err
	}
	defer srv.Close()
	cl, err := a.serveCluster(ctx)
	if err != nil {
		return err
	}
	defer cl.Close()
	ms, err := a.serveMetrics(ctx)
	if err != nil {
		return err
	}
	defer ms.Close()
	// The loops a deadlock would stop, that the ring depends on: beats out, the watch over the predecessor,
	// the self-fence. Beats and the self-fence read the jobs under a.mu, so most deadlocks stop them too.
	a.loops = liveness.New(time.Now(), loopBeats, loopWatchdog, loopSelfFence)
	go a.watchJobs(ctx)
	go a.schedule(ctx)
	go func() {
		// The cuts a previous agent left under way are given up first: their holds would refuse the
		// schedule's freezes of the same runs (the snapshot lock taken).
		a.abortLeftCuts(ctx)
		a.scheduleCuts(ctx)
	}()
	go a.forgetEnded(ctx)
	go a.retryLeftNetsEvery(ctx) // adopt tried them once
	go a.checkConns(ctx)
	go a.controlLog(ctx)
	go a.sendBeats(ctx)
	go a.watchSelf(ctx)
	go a.keepPriority(ctx)
	go a.watchPredecessor(ctx)
	go a.selfFence(ctx)
	go a.watchHealth(ctx)
	go a.pushView(ctx)    // a restarted agent learns what changed while it was away
	go a.watchRejoin(ctx) // and, if it was declared failed, drops its old jobs and comes back as a spare
	merged := make(chan struct{})
	go func() { a.saveMergedFailures(ctx); close(merged) }()
	defer func() { <-merged }() // the last timelines merged from peers are on disk before Run returns
	if adopted > 0 && a.netlog != nil {
		go a.renewReceiverSnapshots(ctx)
	}
	if a.netlog != nil {
		defer a.netlog.node.Close()
		defer a.netlog.tap.Close() // after the recorder: it reads the tap
		defer a.netlog.recorder.Close()
	}
	if a.clamp != nil {
		defer a.closeAckClamp()
	}
	go a.det.Run(ctx)
	close(a.serving)
	<-ctx.Done()
	a.log.Info("agent stopping; jobs keep running under their shims")
	return nil
}
