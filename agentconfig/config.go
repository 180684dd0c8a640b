// Package agentconfig is the node agent's configuration file (docs/agent.example.toml documents every
// key): its types, defaults, parsing, and the checks an operator can act on, apart from the daemon, so
// that a configuration is checked (ftagent --check-config) and written (the lab) without starting one.
package agentconfig

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/ebpfprobes"
	"github.com/ftkit/ftkit/fence"
	"github.com/ftkit/ftkit/intercept/record"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/metrics"
	"github.com/ftkit/ftkit/ring"
)

// Role is what a cluster member is for.
type Role string

const (
	RoleNode  Role = "node"
	RoleSpare Role = "spare"
)

// Mode is how a host's jobs are snapshotted; it is recorded in every snapshot's manifest.
type Mode = ckpt.Mode

const (
	Uncoordinated   = ckpt.ModeUncoordinated
	SemiCoordinated = ckpt.ModeSemiCoordinated
)

// maxParallelRestores bounds failover.parallel_restores: beyond it, restores only compete for the spare's
// disk and memory.
const maxParallelRestores = 16

// maxAcceptWait bounds checkpoint.accept_wait: half of the minute a host holds a run's jobs frozen for a
// coordinated snapshot without word from its coordinator (coordinated.HoldMax).
const maxAcceptWait = 30 * time.Second

// maxKeepEnded bounds checkpoint.keep_ended: a lost job keeps its snapshots 7 times as long (agent
// lostFactor), which must not overflow a time.Duration (some 41 years) and wrap to a negative age that
// forgets them at once. 0 keeps them for good.
const maxKeepEnded = 10 * 365 * 24 * time.Hour

// minHeartbeatInterval bounds heartbeat.interval: the agent's watchdog, self-fence and stall loops tick
// every half interval and a beat goes every interval, so a few nanoseconds (a typo for "500ms") make them
// busy loops and flood the protector with beats. The lab's fastest detection beats every 75 ms.
const minHeartbeatInterval = 10 * time.Millisecond

// minDumpTimeout and maxDumpTimeout bound checkpoint.dump_timeout: no less than CRIU's own bound on the
// freeze of a job's tasks (its --timeout, 10 s), no more than a coordinator waits for a host's dumps
// (clusterapi.MaxCoordStep, which holds the run's jobs on the other hosts frozen meanwhile).
const (
	minDumpTimeout = 10 * time.Second
	maxDumpTimeout = clusterapi.MaxCoordStep
)

// Duration is a time.Duration written as "500ms" in TOML.
type Duration struct{ time.Duration }

func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// Interval is a checkpoint interval: fixed, or Auto (Daly's optimum from measured cost and MTBF).
type Interval struct {
	Auto  bool
	Fixed time.Duration
}

func (i *Interval) UnmarshalText(b []byte) error {
	if string(b) == "auto" {
		*i = Interval{Auto: true}
		return nil
	}
	d, err := time.ParseDuration(string(b))
	if err != nil {
		return fmt.Errorf("interval %q: use a duration like 60s, or auto", b)
	}
	*i = Interval{Fixed: d}
	return nil
}

func (i Interval) MarshalText() ([]byte, error) {
	if i.Auto {
		return []byte("auto"), nil
	}
	return []byte(i.Fixed.String()), nil
}

func (i Interval) String() string { b, _ := i.MarshalText(); return string(b) }

// Member is one host of the cluster.
type Member struct {
	Name    string         `toml:"name"`
	Address netip.AddrPort `toml:"address"`
	Role    Role           `toml:"role"`
}

// Config is the agent's configuration file; docs/agent.example.toml documents every key.
type Config struct {
	Name         string `toml:"name"`
	StateDir     string `toml:"state_dir"`
	Socket       string `toml:"socket"`
	CRIU         string `toml:"criu"`
	JobsDir      string `toml:"jobs_dir"`
	CgroupParent string `toml:"cgroup_parent"`
	// BPFPinDir is where the agent pins the eBPF objects that must outlive it (the ACK clamp of restored
	// sockets); empty: /sys/fs/bpf/ftkit/<name>.
	BPFPinDir string `toml:"bpf_pin_dir"`
	Cluster   struct {
		Listen netip.AddrPort `toml:"listen"`
		CA     string         `toml:"ca"`
		Cert   string         `toml:"cert"`
		Key    string         `toml:"key"`
		// CRL is optional: the CA's revocation list (ftctl pki revoke); a peer it lists is refused.
		CRL string `toml:"crl"`
		// StartJobCommand, if set, admits or refuses each job another member asks this host to start
		// (startjob.go); StartJobCommandTimeout bounds it.
		StartJobCommand        []string `toml:"start_job_command"`
		StartJobCommandTimeout Duration `toml:"start_job_command_timeout"`
		Members                []Member `toml:"member"`
	} `toml:"cluster"`
	Checkpoint struct {
		Mode     Mode     `toml:"mode"`
		Interval Interval `toml:"interval"`
		// MinInterval is the shortest fixed interval a job may ask for, and the shortest time between two
		// manual checkpoints of a non-root user: any local user can start a job, and every dump costs the
		// host CPU, I/O and a transfer to the protector.
		MinInterval Duration `toml:"min_interval"`
		// MaxJobsPerUser is the most jobs a user other than root may run on this host at once (0: no
		// bound): each one is snapshotted at its interval, so their number multiplies what one user costs
		// the host and its protector, beside other users' jobs.
		MaxJobsPerUser int      `toml:"max_jobs_per_user"`
		MTBF           Duration `toml:"mtbf"`
		Keep           int      `toml:"keep"`
		// KeepEnded is how long a job that ended on this host (exited, lost, moved) keeps its snapshots,
		// here and on the protectors that hold its replicas, and its record: then they go (agent forgetEnded).
		// 0 keeps them for good.
		KeepEnded Duration `toml:"keep_ended"`
		// DumpNice is the nice value of the agent's autogroup while CRIU dumps a job, and while the agent
		// keeps jobs frozen (a semi-coordinated snapshot, a migration's stop, a coordinated freeze): CRIU
		// runs in the agent's session, and the job stays stopped until the work is done, so it goes before
		// the host's other sessions (the jobs) meanwhile. A group already higher (heartbeat.nice) keeps its
		// value. 0: unchanged.
		DumpNice int `toml:"dump_nice"`
		// AcceptWait bounds how long a snapshot waits for a job to accept the connections waiting in its
		// listen queues, which CRIU cannot dump. A coordinated snapshot waits with the run's jobs on the
		// other hosts frozen, so it is bounded well below a frozen run's hold (a minute).
		AcceptWait Duration `toml:"accept_wait"`
		// DumpTimeout bounds one snapshot's dump, from CRIU's start to the snapshot's commit: past it CRIU
		// is killed and the snapshot dropped, with an error. A CRIU that hangs (a task it cannot freeze or
		// seize, a file system that does not answer) otherwise kept the job stopped, and the host's snapshot
		// lock held, for good.
		DumpTimeout Duration `toml:"dump_timeout"`
		// ShareBlocks lets a replica rebuilt from a diff share the disk blocks it takes from its base where
		// the store's file system can (XFS with reflink, btrfs), instead of writing them again
		// (ship.ReceiveOptions.ShareBlocks). Off by default: a shared block is not in the page
		// cache under the new replica's name (a recovery, and the next diff, read it from the disk), and it
		// is one copy on disk for every replica that shares it.
		ShareBlocks bool `toml:"share_blocks"`
	} `toml:"checkpoint"`
	Heartbeat struct {
		Interval  Duration `toml:"interval"`
		Timeout   Duration `toml:"timeout"`
		BusyGrace Duration `toml:"busy_grace"`
		// ProbeTimeout bounds the direct probe that confirms a suspicion (0: timeout). A crashed host does
		// not answer at all, so confirmation costs this long; a live one answers a ping in milliseconds.
		ProbeTimeout Duration `toml:"probe_timeout"`
		// Nice is the agent's own nice value. Negative, CPU-bound jobs or a hog cannot starve its heartbeats
		// and probes (corosync runs at realtime priority for this reason); positive, the agent's steady work
		// (the log, the determinants, shipping and receiving snapshots) waits for the jobs' CPU instead,
		// while CRIU still dumps at checkpoint.dump_nice (restores run in the job's shim, a session of its
		// own). The processes the agent starts (shims, jobs, CRIU) run at nice 0 (SCHED_RESET_ON_FORK). Its
		// autogroup gets it too (package autogroup), which CRIU, in the agent's session, shares. 0: unchanged.
		Nice int `toml:"nice"`
	} `toml:"heartbeat"`
	Failover struct {
		// Automatic: the protector restores a confirmed-failed predecessor's jobs on a spare (or on itself)
		// at once. Off: the failure is only reported, and the operator restores with `ftctl restore`.
		Automatic bool `toml:"automatic"`
		// ReplayTimeout bounds how long a restored job may take to re-send what its peers had received:
		// one that has not by then (it diverged and waits for a message nobody will send) is killed and
		// the recovery fails, naming the connection.
		ReplayTimeout Duration `toml:"replay_timeout"`
		// ParallelRestores is how many of a failed node's jobs the target fetches, plans and restores at
		// once (1: one after another). Each restore holds its job's images and CRIU's memory at the same time.
		ParallelRestores int `toml:"parallel_restores"`
		// LazyRestore restores a job's memory on first touch (CRIU's lazy pages, from the local images):
		// the job runs again without waiting for all its pages, which arrive in the background.
		LazyRestore bool `toml:"lazy_restore"`
		// FenceTimeout is how long a node may hear from neither ring neighbour before it kills its protected
		// jobs (self-fencing); the protector waits longer than that before a restored copy goes live. 0:
		// 2 × heartbeat.timeout + 1s (heartbeat.timeout + probe_timeout + 1s if longer). At least
		// heartbeat.timeout + probe_timeout. The same value on every member.
		FenceTimeout Duration `toml:"fence_timeout"`
		// FenceCommand, if set, is run by the protector before a takeover ({host} and {address} substituted):
		// exit status 0 confirms the failed host is off and the fence wait is skipped.
		FenceCommand        []string `toml:"fence_command"`
		FenceCommandTimeout Duration `toml:"fence_command_timeout"`
	} `toml:"failover"`
	// Health is the site's failure predictor (HealthConfig).
	Health HealthConfig `toml:"health"`
	Log    LogConfig    `toml:"log"`
	// JobNetwork gives jobs that ask for one an address of their own (JobNetworkConfig); off without a pool.
	JobNetwork JobNetworkConfig `toml:"job_network"`

	Metrics struct {
		// Listen is the ip:port of the Prometheus endpoint (/metrics); empty: none. The endpoint has no
		// authentication and names jobs and members: keep it on loopback unless the network is trusted.
		Listen string `toml:"listen"`
	} `toml:"metrics"`
}

// LogConfig configures the sender-side log of the bytes this host's jobs send to other hosts.
type LogConfig struct {
	Enabled   bool   `toml:"enabled"`
	Interface string `toml:"interface"` // egress interface; empty: the one holding cluster.listen's address
	RingMiB   int    `toml:"ring_mib"`  // eBPF ring buffer (power of two); full means TCP backpressure, never loss
	// MaxFlows is how many protected connections of this host keep a live state in the capture at once
	// (the least recently active is forgotten beyond it; a recovery needs the state of a peer that sent
	// nothing since the snapshot). Each costs the kernel 120 bytes, preallocated (7.9 MB for the default).
	MaxFlows  int     `toml:"max_flows"`
	MemoryMiB int     `toml:"memory_mib"` // cap on the log's RAM; 0: 10% of this host's memory
	High      float64 `toml:"high"`       // fraction of the cap at which destination nodes are asked to snapshot
	Low       float64 `toml:"low"`        // fraction of the cap the controller aims for
	SpillDir  string  `toml:"spill_dir"`  // last resort when snapshots do not free enough; empty: never spill
	// Park keeps sent segments of 4 KiB or more as clones in the kernel (a tap device, ftpark0, with a
	// queue per CPU and bucket of destinations) instead of copying them into the log as they leave: a
	// clone shares the segment's pages, so the sender pays no copy, and a clone whose bytes a receiver's
	// snapshot covers is freed unread. Clones are copied into the log only for a recovery or once the
	// park is three quarters full (docs/design.md). On by default. ParkMiB bounds the payload waiting in
	// clones, kernel memory outside the log's cap; 0: a quarter of the log's cap, at most 256. A
	// recovery's read of the log first takes the clones of its destination's bucket into it, so the cap
	// also bounds that wait (until 2026-12-06 it took every clone: with 602 MiB that took a loaded host
	// past the reader's 10 s stall bound, ci285).
	Park    bool `toml:"park"`
	ParkMiB int  `toml:"park_mib"`
	// ReceiveOrder records the order in which jobs consume their connections (package intercept), so that
	// a restored job re-reads them in that order. Off, a job that reads whichever socket has data first
	// fails its recovery (loudly) when it reads another one first.
	ReceiveOrder bool `toml:"receive_order"`
	// ReceivePositions also records, with receive_order, each receive call's place among its thread's
	// readiness calls, and replays it (intercept's receive positions: MPI_Waitany, MPI_ANY_SOURCE). It counts
	// every job thread's epoll_wait/poll/select (every system call of the host then takes the kernel's traced
	// exit path) and freezes each job for its snapshots. Off by default for its cost (docs/receive-order.md).
	ReceivePositions bool `toml:"receive_positions"`
	// Pessimistic, with receive_order, stops a job's process after each receive call that consumed bytes
	// until the call's determinant is stored at the job's protector: nothing the process sends afterwards
	// depends on a determinant a crash could take (no orphans), at the price of a round trip to the
	// protector per receive call. Each snapshot freezes the job. Off by default (docs/receive-order.md).
	Pessimistic bool `toml:"pessimistic"`
	// ReceiveOrderShipEvery is the least time between two shipments of a job's determinants to its
	// protector: longer costs the jobs less (one cluster request per shipment), shorter leaves a crash fewer
	// determinants to take with it (orphans, docs/receive-order.md). 0: every call as soon as it is
	// recorded, the agent woken for each (the lowest lag, at several times the cost).
	ReceiveOrderShipEvery Duration `toml:"receive_order_ship_every"`
}

// maxRingMiB bounds log.ring_mib: the eBPF ring buffers take at most 2 GiB (ebpfprobes).
const maxRingMiB = 2048

// maxMiB bounds log.memory_mib and log.park_mib (1 PiB): larger, their bytes overflow an int64.
const maxMiB = 1 << 30

// minMaxFlows is log.max_flows' least value: fewer would have idle connections of an ordinary host lose
// their live state.
const minMaxFlows = 1024

// Defaults returns a Config with every default filled in.
func Defaults() Config {
	var c Config
	c.StateDir = "/var/lib/ftkit"
	c.Socket = "/run/ftkit/agent.sock"
	c.JobsDir = "/var/lib/ftkit/jobs"
	c.CgroupParent = "/sys/fs/cgroup/unified/ftkit"
	c.Checkpoint.Mode = Uncoordinated
	c.Checkpoint.Interval = Interval{Fixed: 60 * time.Second}
	c.Checkpoint.MinInterval = Duration{time.Second}
	c.Checkpoint.MaxJobsPerUser = 256
	c.Checkpoint.MTBF = Duration{24 * time.Hour}
	c.Checkpoint.Keep = 3
	c.Checkpoint.KeepEnded = Duration{24 * time.Hour}
	c.Checkpoint.DumpNice = -10
	c.Checkpoint.AcceptWait = Duration{2 * time.Second}
	c.Checkpoint.DumpTimeout = Duration{maxDumpTimeout}
	c.Heartbeat.Interval = Duration{500 * time.Millisecond}
	c.Heartbeat.Timeout = Duration{3 * time.Second}
	c.Heartbeat.BusyGrace = Duration{60 * time.Second}
	c.Failover.Automatic = true
	c.Failover.ReplayTimeout = Duration{2 * time.Minute}
	c.Failover.ParallelRestores = 4
	c.Failover.FenceCommandTimeout = Duration{30 * time.Second}
	c.Cluster.StartJobCommandTimeout = Duration{10 * time.Second}
	c.Health = HealthConfig{Interval: Duration{30 * time.Second}, Timeout: Duration{10 * time.Second}, LeadTime: Duration{30 * time.Minute}}
	c.Log = LogConfig{Enabled: true, RingMiB: 64, High: 0.8, Low: 0.6, ReceiveOrder: true, ReceiveOrderShipEvery: Duration{record.DefaultShipEvery},
		MaxFlows: ebpfprobes.DefaultMaxFlows, Park: true}
	c.JobNetwork.Kind = jobnet.MACVlan
	c.JobNetwork.Linger = Duration{30 * time.Second}
	return c
}

// LoadConfig reads and validates a configuration file; unknown keys are errors (a typo must not silently
// fall back to a default).
func LoadConfig(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("read agent config: %w", err)
	}
	c, err := ParseConfig(b)
	if err != nil {
		return Config{}, fmt.Errorf("agent config %s: %w", path, err)
	}
	return c, nil
}

// ParseConfig decodes and validates a configuration.
func ParseConfig(b []byte) (Config, error) {
	c := Defaults()
	dec := toml.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		var sme *toml.StrictMissingError
		if errors.As(err, &sme) {
			return Config{}, fmt.Errorf("unknown key: %s", sme.String())
		}
		var de *toml.DecodeError
		if errors.As(err, &de) {
			row, col := de.Position()
			return Config{}, fmt.Errorf("line %d column %d: %s", row, col, de.Error())
		}
		return Config{}, err
	}
	return c, c.Validate()
}

// Validate checks the configuration for mistakes an operator can fix.
func (c Config) Validate() error {
	var errs []error
	if c.Name == "" {
		errs = append(errs, errors.New("name: this host's member name is required"))
	}
	if c.StateDir == "" || c.JobsDir == "" || c.Socket == "" || c.CgroupParent == "" {
		errs = append(errs, errors.New("state_dir, jobs_dir, socket and cgroup_parent must not be empty"))
	}
	// Relative, they would name whatever lies below the agent's working directory (/ under systemd, elsewhere
	// when started by hand or checked by --check-config), and jobs_dir must be the same path on every host.
	for _, p := range []struct{ key, path string }{
		{"state_dir", c.StateDir}, {"jobs_dir", c.JobsDir}, {"socket", c.Socket}, {"cgroup_parent", c.CgroupParent},
		{"bpf_pin_dir", c.BPFPinDir}, {"log.spill_dir", c.Log.SpillDir},
	} {
		if p.path != "" && !filepath.IsAbs(p.path) {
			errs = append(errs, fmt.Errorf("%s %q: give an absolute path (a relative one depends on the agent's working directory)", p.key, p.path))
		}
	}
	// jobs_dir is the same path on every host, usually one shared file system, and users' (public): a state_dir
	// there would be every such host's at once, each agent overwriting the others' records, grants and claims.
	if filepath.IsAbs(c.StateDir) && filepath.IsAbs(c.JobsDir) {
		if rel, err := filepath.Rel(c.JobsDir, c.StateDir); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			errs = append(errs, fmt.Errorf("state_dir %q is jobs_dir or lies inside it: give it a directory of this host's own (jobs_dir may lie inside state_dir)", c.StateDir))
		}
	}
	if c.CRIU != "" && !filepath.IsAbs(c.CRIU) {
		// Run as root: not looked up relative to wherever the agent was started.
		errs = append(errs, fmt.Errorf("criu %q: give the binary by absolute path (empty: %s, then PATH)", c.CRIU, criu.DefaultBinary))
	}
	memberErrs := len(errs)
	seenName, seenAddr := map[string]bool{}, map[netip.AddrPort]bool{}
	self := false
	nodes := 0
	for i, m := range c.Cluster.Members {
		switch {
		case m.Name == "":
			errs = append(errs, fmt.Errorf("cluster.member %d: name is required", i+1))
		case seenName[m.Name]:
			errs = append(errs, fmt.Errorf("cluster.member %q appears twice", m.Name))
		case !m.Address.IsValid():
			errs = append(errs, fmt.Errorf("cluster.member %q: address must be ip:port", m.Name))
		case seenAddr[m.Address]:
			errs = append(errs, fmt.Errorf("cluster.member %q: address %s is used twice", m.Name, m.Address))
		case m.Role != RoleNode && m.Role != RoleSpare:
			errs = append(errs, fmt.Errorf("cluster.member %q: role %q: use node or spare", m.Name, m.Role))
		}
		seenName[m.Name], seenAddr[m.Address] = true, true
		self = self || m.Name == c.Name
		if m.Role == RoleNode {
			nodes++
		}
	}
	if len(c.Cluster.Members) > 0 && !self {
		errs = append(errs, fmt.Errorf("name %q is not a cluster.member", c.Name))
	}
	if len(c.Cluster.Members) > 0 && nodes < 2 {
		errs = append(errs, errors.New("cluster: a protection ring needs at least 2 members with role node"))
	} else if len(errs) == memberErrs {
		// The agent's first view is made of these members (agent loadView), and the view refuses more than
		// the checks above: names that cannot be a certificate's (upper case, '_'), port 0, and two members
		// on one host address. Refused here, not by an agent that will not start.
		ms := make([]ring.Member, 0, len(c.Cluster.Members))
		for _, m := range c.Cluster.Members {
			ms = append(ms, ring.Member{Name: m.Name, Address: m.Address, Role: ring.Role(m.Role), State: ring.StateAlive})
		}
		if _, err := ring.New(ms); err != nil && len(ms) > 0 {
			errs = append(errs, fmt.Errorf("cluster.member: %w", err))
		}
	}
	switch c.Checkpoint.Mode {
	case Uncoordinated, SemiCoordinated:
	default:
		errs = append(errs, fmt.Errorf("checkpoint.mode %q: use uncoordinated or semi-coordinated", c.Checkpoint.Mode))
	}
	if c.Checkpoint.MinInterval.Duration <= 0 {
		errs = append(errs, fmt.Errorf("checkpoint.min_interval %s: must be positive", c.Checkpoint.MinInterval))
	} else if !c.Checkpoint.Interval.Auto && c.Checkpoint.Interval.Fixed < c.Checkpoint.MinInterval.Duration {
		errs = append(errs, fmt.Errorf("checkpoint.interval %s is below checkpoint.min_interval: use at least %s, or auto",
			c.Checkpoint.Interval.Fixed, c.Checkpoint.MinInterval))
	}
	// Always: a job may ask for interval auto (CheckJobInterval) whatever the agent's own interval is.
	if c.Checkpoint.MTBF.Duration <= 0 {
		errs = append(errs, fmt.Errorf("checkpoint.mtbf %s must be positive (a job's interval auto is computed from it)", c.Checkpoint.MTBF))
	}
	if c.Checkpoint.MaxJobsPerUser < 0 {
		errs = append(errs, fmt.Errorf("checkpoint.max_jobs_per_user %d: use a number of jobs, or 0 for no bound", c.Checkpoint.MaxJobsPerUser))
	}
	if c.Checkpoint.Keep < 1 {
		errs = append(errs, fmt.Errorf("checkpoint.keep %d: keep at least 1 snapshot", c.Checkpoint.Keep))
	}
	if k := c.Checkpoint.KeepEnded.Duration; k < 0 || k > maxKeepEnded {
		errs = append(errs, fmt.Errorf("checkpoint.keep_ended %s: use a duration of at most %s (ten years; a lost job keeps its snapshots 7 times as long), or 0 to keep an ended job's snapshots for good",
			c.Checkpoint.KeepEnded, maxKeepEnded))
	}
	if d := c.Log.ReceiveOrderShipEvery.Duration; d < 0 || d > record.MaxShipEvery {
		errs = append(errs, fmt.Errorf("log.receive_order_ship_every %s: must be between 0 (at once) and %s", c.Log.ReceiveOrderShipEvery, record.MaxShipEvery))
	}
	if c.Failover.ReplayTimeout.Duration <= 0 {
		errs = append(errs, fmt.Errorf("failover: replay_timeout (%s) must be positive", c.Failover.ReplayTimeout))
	}
	if c.Failover.ParallelRestores < 1 || c.Failover.ParallelRestores > maxParallelRestores {
		errs = append(errs, fmt.Errorf("failover: parallel_restores %d: 1 (one job after another) to %d", c.Failover.ParallelRestores, maxParallelRestores))
	}
	if c.Heartbeat.Interval.Duration <= 0 || c.Heartbeat.Timeout.Duration <= c.Heartbeat.Interval.Duration {
		errs = append(errs, fmt.Errorf("heartbeat: timeout (%s) must be longer than a positive interval (%s)", c.Heartbeat.Timeout, c.Heartbeat.Interval))
	} else if c.Heartbeat.Interval.Duration < minHeartbeatInterval {
		errs = append(errs, fmt.Errorf("heartbeat.interval %s: use at least %s (the agent's loops tick every half interval; did you mean ms?)", c.Heartbeat.Interval, minHeartbeatInterval))
	}
	if c.Failover.FenceTimeout.Duration < 0 {
		errs = append(errs, fmt.Errorf("failover.fence_timeout %s must not be negative (0: 2 × heartbeat.timeout + 1s)", c.Failover.FenceTimeout))
	} else if err := c.FenceTiming().Validate(c.Heartbeat.Timeout.Duration); err != nil {
		errs = append(errs, fmt.Errorf("failover: %w", err))
	} else if ft, declare := c.FenceTiming().Timeout, c.declareBound(); ft < declare {
		// fence.Timing.Validate assumes the confirming probe takes at most heartbeat.timeout; a longer
		// probe_timeout delays the declaration further, and a node that fenced itself meanwhile has killed
		// jobs that nobody restores once the probe reaches it again.
		errs = append(errs, fmt.Errorf("failover.fence_timeout %s is shorter than heartbeat.timeout + heartbeat.probe_timeout (%s): a node would kill its jobs before its protector could declare it failed; use at least %s",
			ft, declare, declare))
	}
	if err := checkStartJobCommand(c.Cluster.StartJobCommand, c.Cluster.StartJobCommandTimeout.Duration); err != nil {
		errs = append(errs, err)
	}
	if err := fence.CheckArgv(c.Failover.FenceCommand); err != nil {
		errs = append(errs, fmt.Errorf("failover: %w", err))
	}
	if c.Failover.FenceCommandTimeout.Duration <= 0 {
		errs = append(errs, fmt.Errorf("failover.fence_command_timeout %s must be positive", c.Failover.FenceCommandTimeout))
	}
	if err := c.Health.validate(); err != nil {
		errs = append(errs, fmt.Errorf("health: %w", err))
	}
	if c.Checkpoint.DumpNice < -20 || c.Checkpoint.DumpNice > 0 {
		errs = append(errs, fmt.Errorf("checkpoint.dump_nice %d must be between -20 and 0 (0: unchanged)", c.Checkpoint.DumpNice))
	}
	if w := c.Checkpoint.AcceptWait.Duration; w <= 0 || w > maxAcceptWait {
		errs = append(errs, fmt.Errorf("checkpoint.accept_wait %s must be positive and at most %s", c.Checkpoint.AcceptWait, maxAcceptWait))
	}
	if d := c.Checkpoint.DumpTimeout.Duration; d < minDumpTimeout || d > maxDumpTimeout {
		errs = append(errs, fmt.Errorf("checkpoint.dump_timeout %s must be between %s and %s", c.Checkpoint.DumpTimeout, minDumpTimeout, maxDumpTimeout))
	}
	if c.Heartbeat.Nice < -20 || c.Heartbeat.Nice > 19 {
		errs = append(errs, fmt.Errorf("heartbeat.nice %d must be between -20 and 19 (0: unchanged)", c.Heartbeat.Nice))
	}
	if c.Heartbeat.ProbeTimeout.Duration < 0 {
		errs = append(errs, fmt.Errorf("heartbeat.probe_timeout %s must not be negative (0: heartbeat.timeout)", c.Heartbeat.ProbeTimeout))
	} else if p := c.ProbeTimeout(); p > MaxProbeTimeout {
		// A confirmation runs in the loop that watches the predecessor, and takes up to 2 × probe_timeout
		// (the other neighbour's probe, relayed): longer, and systemd's watchdog (WatchdogSec=60s, the loop
		// stale after half) restarts the agent in the middle of a fail-over.
		errs = append(errs, fmt.Errorf("heartbeat.probe_timeout %s (heartbeat.timeout when unset) must be at most %s: a confirmation takes up to twice as long, in the loop systemd's watchdog watches", p, MaxProbeTimeout))
	}
	if c.Heartbeat.BusyGrace.Duration < 0 {
		errs = append(errs, fmt.Errorf("heartbeat.busy_grace %s must not be negative", c.Heartbeat.BusyGrace))
	}
	if c.Log.Enabled {
		if c.Log.RingMiB <= 0 || c.Log.RingMiB&(c.Log.RingMiB-1) != 0 || c.Log.RingMiB > maxRingMiB {
			errs = append(errs, fmt.Errorf("log.ring_mib %d: use a power of two, at most %d", c.Log.RingMiB, maxRingMiB))
		}
		if c.Log.MaxFlows < minMaxFlows || c.Log.MaxFlows > ebpfprobes.MaxMaxFlows {
			errs = append(errs, fmt.Errorf("log.max_flows %d: use %d..%d", c.Log.MaxFlows, minMaxFlows, ebpfprobes.MaxMaxFlows))
		}
		if c.Log.ParkMiB < 0 || c.Log.ParkMiB > maxMiB {
			errs = append(errs, fmt.Errorf("log.park_mib %d: use 0 (a quarter of the log's cap) to %d", c.Log.ParkMiB, maxMiB))
		}
		if c.Log.MemoryMiB > maxMiB {
			errs = append(errs, fmt.Errorf("log.memory_mib %d: use 0 (10%% of this host's memory) to %d", c.Log.MemoryMiB, maxMiB))
		}
		if c.Log.MemoryMiB < 0 || !(0 < c.Log.Low && c.Log.Low < c.Log.High && c.Log.High <= 1) {
			errs = append(errs, fmt.Errorf("log: memory_mib must be >= 0 and 0 < low (%.2f) < high (%.2f) <= 1", c.Log.Low, c.Log.High))
		}
	}
	// Both act on the recorded receive order only (agent: recording is log.enabled && log.receive_order).
	if (c.Log.Pessimistic || c.Log.ReceivePositions) && !(c.Log.Enabled && c.Log.ReceiveOrder) {
		errs = append(errs, fmt.Errorf("log.pessimistic (%t) and log.receive_positions (%t) need log.enabled and log.receive_order: without them nothing is recorded",
			c.Log.Pessimistic, c.Log.ReceivePositions))
	}
	if err := c.JobNetwork.validate(); err != nil {
		errs = append(errs, err)
	}
	if err := metrics.CheckListen(c.Metrics.Listen); err != nil {
		errs = append(errs, fmt.Errorf("metrics.listen %w", err))
	}
	return errors.Join(errs...)
}

// MaxProbeTimeout bounds heartbeat.probe_timeout (Validate says why).
const MaxProbeTimeout = 10 * time.Second

// ProbeTimeout is heartbeat.probe_timeout, its default filled in.
func (c Config) ProbeTimeout() time.Duration {
	if c.Heartbeat.ProbeTimeout.Duration > 0 {
		return c.Heartbeat.ProbeTimeout.Duration
	}
	return c.Heartbeat.Timeout.Duration
}

// FenceTiming is the self-fencing timing of this configuration, fence_timeout's default filled in.
func (c Config) FenceTiming() fence.Timing {
	t := fence.Timing{Interval: c.Heartbeat.Interval.Duration, Timeout: c.Failover.FenceTimeout.Duration}
	if t.Timeout == 0 {
		t.Timeout = max(2*c.Heartbeat.Timeout.Duration, c.declareBound()) + time.Second
	}
	return t
}

// declareBound is the longest a protector takes to declare a silent predecessor failed: heartbeat.timeout
// of silence, then the direct probe that confirms it (heartbeat.probe_timeout).
func (c Config) declareBound() time.Duration {
	return c.Heartbeat.Timeout.Duration + c.ProbeTimeout()
}

// CheckJobInterval validates the interval a job asks for ("" means the agent's own): a duration of at
// least checkpoint.min_interval, or auto (whose computed period the scheduler clamps).
func (c Config) CheckJobInterval(s string) error {
	if s == "" {
		return nil
	}
	var iv Interval
	if err := iv.UnmarshalText([]byte(s)); err != nil {
		return err
	}
	if !iv.Auto && iv.Fixed <= 0 {
		return fmt.Errorf("interval %s: use a positive duration of at least %s, or auto", s, c.Checkpoint.MinInterval)
	}
	if !iv.Auto && iv.Fixed < c.Checkpoint.MinInterval.Duration {
		return fmt.Errorf("interval %s is below this agent's minimum of %s (checkpoint.min_interval): ask for at least %s, or auto",
			s, c.Checkpoint.MinInterval, c.Checkpoint.MinInterval)
	}
	return nil
}

// Member returns the member with the given name.
func (c Config) Member(name string) (Member, bool) {
	for _, m := range c.Cluster.Members {
		if m.Name == name {
			return m, true
		}
	}
	return Member{}, false
}
