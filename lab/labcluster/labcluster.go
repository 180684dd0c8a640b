// Package labcluster runs an ftkit agent inside every host of a lab: configuration, directories, start,
// readiness, and restart (for tests that kill an agent). Lab teardown removes all of it.
package labcluster

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentapi"
	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/jobnet"
	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/slurm"
)

// AgentPort is the cluster port of every lab agent.
const AgentPort = 7420

// FastDetection is the lab's detection for crash -> confirmed failure under 0.5 s (ftbench detect; docs/
// detection.md has the measurements): beats every 75 ms, suspicion after 300 ms, probes bounded by 200 ms,
// and agents at nice -20 so that the jobs and hogs sharing the machine's cores do not starve them (-10 until
// 2026-12-01: in the detect soak, the agents' beats came 150 ms or more after the one before 40 and 54
// times in two runs, against 17 at -20). Measured about 0.5 s median with no false suspicion in most
// 10-minute soaks under load; 50/200/150 ms detected in 392 ms but raised false suspicions. It is not the
// default: the end-to-end tests share the machine with other labs and must not fail over live nodes.
func FastDetection(o Options) Options {
	o.Heartbeat, o.HeartbeatTimeout, o.ProbeTimeout, o.Nice = 75*time.Millisecond, 300*time.Millisecond, 200*time.Millisecond, -20
	return o
}

// Options shape the agents' configuration.
type Options struct {
	AgentBin string // path to ftagent
	Interval string // checkpoint interval ("" = 60s)
	Mode     agent.Mode
	Keep     int
	LogLevel string // ftagent --log-level ("" = info)
	// LogMemoryMiB and LogRingMiB bound the agents' sender-side logs (0: the agent defaults).
	LogMemoryMiB, LogRingMiB int
	// LogNoPark has the agents copy every segment into the log's ring, none parked (log.park = false).
	LogNoPark bool
	// Heartbeat and HeartbeatTimeout drive failure detection (0: 200ms and 1s, quicker than a real
	// cluster's defaults because the lab's links never lose a beat); ProbeTimeout bounds the confirmation
	// (0: HeartbeatTimeout). FastDetection sets quicker ones.
	Heartbeat, HeartbeatTimeout, ProbeTimeout time.Duration
	// Nice is every agent's heartbeat.nice (0: unchanged).
	Nice int
	// ManualFailover turns automatic fail-over off (failures are only detected and reported).
	ManualFailover bool
	// LateSpares is how many of the lab's last spares are left out of the other hosts' configurations:
	// they run an agent but join the pool only when registered with `ftctl spare add`.
	LateSpares int
	// MetricsListen is every agent's metrics.listen ("": no endpoint). Each agent listens in its own
	// host's network namespace, so one loopback address serves them all.
	MetricsListen string
	// FenceCommand and FenceTimeout are every agent's failover.fence_command and fence_timeout (nil, 0:
	// none, and the default).
	FenceCommand []string
	FenceTimeout time.Duration
	// ReplayTimeout is every agent's failover.replay_timeout (0: the default).
	ReplayTimeout time.Duration
	// NoReceiveOrder turns every agent's log.receive_order off.
	NoReceiveOrder bool
	// ReceivePositions turns every agent's log.receive_positions on.
	ReceivePositions bool
	// Pessimistic turns every agent's log.pessimistic on.
	Pessimistic bool
	// ShipEvery is every agent's log.receive_order_ship_every (0: the default).
	ShipEvery time.Duration
	// ParallelRestores is every agent's failover.parallel_restores (0: the default).
	ParallelRestores int
	// JobAddresses gives every agent a job_network.pool (JobPool) and gateway (JobGateway), so that jobs
	// may ask for an address of their own.
	JobAddresses bool
	// HealthCommand and HealthInterval are every agent's health.command and health.interval (nil, 0: no
	// health command; the interval's default). The command's timeout is the interval.
	HealthCommand  []string
	HealthInterval time.Duration
	// LazyRestore is every agent's failover.lazy_restore.
	LazyRestore bool
	// AcceptWait is every agent's checkpoint.accept_wait (0: the default).
	AcceptWait time.Duration
	// KeepEnded is every agent's checkpoint.keep_ended (0: the default).
	KeepEnded time.Duration
}

// Job address pools of a lab: the hosts are .11 up and the spares .101 up in the lab's subnet; host i
// (in the lab's order, from 0) hands out the 4 addresses from .200+4i, for the first 13 hosts.
const (
	jobPoolBase = 200
	jobPoolSize = 4
)

// JobPool is host's job_network.pool in a lab started with Options.JobAddresses; invalid (zero) for a
// host beyond the 13th, which then hands out none.
func JobPool(st lab.State, host string) netip.Prefix {
	for i, h := range st.Hosts {
		if h.Name != host {
			continue
		}
		n := jobPoolBase + jobPoolSize*i
		if n+jobPoolSize > 255 {
			return netip.Prefix{}
		}
		b := st.Subnet.Masked().Addr().As4()
		b[3] += byte(n)
		return netip.PrefixFrom(netip.AddrFrom4(b), 32-2) // jobPoolSize addresses
	}
	return netip.Prefix{}
}

// JobGateway is every job network's gateway in a lab started with Options.JobAddresses: the lab's router
// (the subnet's .1), which refuses at once whatever is sent beyond the lab (lab.Plan.Router).
func JobGateway(st lab.State) netip.Addr { return st.Router.Addr.Addr() }

// Cluster is a lab whose hosts each run an agent.
type Cluster struct {
	Lab     *lab.Lab
	opts    Options
	runDir  string // sockets, configs, logs: /run/ftkit/labs/<id>.d
	dataDir string // state and job directories: /var/lib/ftkit/labs/<id>
	agents  map[string]*runningAgent
	tls     map[string]clustertls.Config
}

type runningAgent struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the agent process has been reaped
}

// Paths of a lab's agent files, derived from the lab id so that ftctl can find them in a later run.
func runDir(id string) string  { return filepath.Join(lab.DefaultStateDir, id+".d") }
func dataDir(id string) string { return filepath.Join("/var/lib/ftkit/labs", id) }

// pinDir holds the eBPF pins of the lab's agents: the lab's hosts share the machine's bpffs, and labs with
// the same host names run side by side. It and cgroupDir are top-level directories of their own, not
// under the agent's defaults (/sys/fs/bpf/ftkit, /sys/fs/cgroup/unified/ftkit): a lab removes what it
// made, and a parent it shared with other labs, or with an agent of the machine, would stay behind.
func pinDir(id string) string    { return filepath.Join("/sys/fs/bpf", "ftkit-lab-"+id) }
func cgroupDir(id string) string { return filepath.Join(cgroupMount, "ftkit-lab-"+id) }

// cgroupMount is where the lab's cgroup v2 hierarchy is mounted.
const cgroupMount = "/sys/fs/cgroup/unified"

// CgroupParent is the cgroup_parent of host's agent in lab id: a tree of its own, as on separate machines.
func CgroupParent(id, host string) string { return filepath.Join(cgroupDir(id), host) }

// Socket is the local API socket of host's agent in lab id.
func Socket(id, host string) string { return filepath.Join(runDir(id), host, "agent.sock") }

// PKIDir holds lab id's cluster CA (cluster_ca.crt, cluster_ca.key) and every host's credentials, root's
// alone (0700).
func PKIDir(id string) string { return filepath.Join(runDir(id), "pki") }

// JobsDir is the lab's cluster-wide job directory (one file system, like a shared home on a cluster).
func JobsDir(id string) string { return filepath.Join(dataDir(id), "jobs") }

// StateDir is the state_dir of host's agent in lab id; its snapshot store is the snapshots directory in it.
func StateDir(id, host string) string { return filepath.Join(dataDir(id), host) }

// Start writes every host's configuration and starts the agents, then waits until each answers.
func Start(ctx context.Context, l *lab.Lab, opts Options) (*Cluster, error) {
	if opts.Interval != "" {
		var iv agent.Interval
		if err := iv.UnmarshalText([]byte(opts.Interval)); err != nil {
			return nil, err
		}
	}
	st := l.State()
	c := &Cluster{Lab: l, opts: opts, runDir: runDir(st.ID), dataDir: dataDir(st.ID), agents: map[string]*runningAgent{}, tls: map[string]clustertls.Config{}}
	for _, d := range []string{c.runDir, c.dataDir, cgroupDir(st.ID), pinDir(st.ID)} {
		if err := l.AddCleanup(d); err != nil {
			return nil, err
		}
	}
	// Other users reach their host's agent socket through runDir; only the pki directory inside is private.
	if err := os.MkdirAll(c.runDir, 0o755); err != nil {
		return nil, err
	}
	ca, err := clustertls.NewCA("ftkit-lab-"+st.ID, 30*24*time.Hour)
	if err != nil {
		return nil, err
	}
	// The CA stays in the lab's private pki directory, so that `ftctl pki issue --dir` can sign operator
	// certificates for the lab (the lab is one machine's: there is no member host to keep it off).
	if err := clustertls.WriteCA(PKIDir(st.ID), ca); err != nil {
		return nil, err
	}
	for _, h := range st.Hosts {
		cert, key, err := ca.Issue(h.Name, []netip.Addr{h.Addr.Addr()}, 29*24*time.Hour)
		if err != nil {
			return nil, err
		}
		tlsCfg, err := clustertls.WriteFiles(PKIDir(st.ID), h.Name, ca.CertPEM(), cert, key)
		if err != nil {
			return nil, err
		}
		c.tls[h.Name] = tlsCfg
	}
	for _, h := range st.Hosts {
		if err := c.writeConfig(st, h); err != nil {
			return nil, fmt.Errorf("configure agent on %s: %w", h.Name, err)
		}
	}
	for _, h := range st.Hosts {
		if h.Crashed {
			continue
		}
		if err := c.StartAgent(ctx, h.Name); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Open returns the cluster of a lab whose agents a previous Start (another process: `ftctl lab up`)
// configured, to start agents again from their written configurations; ok is false when the lab has
// no agents. Only opts.AgentBin and opts.LogLevel matter.
func Open(l *lab.Lab, opts Options) (c *Cluster, ok bool) {
	st := l.State()
	c = &Cluster{Lab: l, opts: opts, runDir: runDir(st.ID), dataDir: dataDir(st.ID), agents: map[string]*runningAgent{}, tls: map[string]clustertls.Config{}}
	_, err := os.Stat(c.ConfigPath(st.Hosts[0].Name))
	return c, err == nil
}

// Config builds the agent configuration of one lab host.
func (c *Cluster) config(st lab.State, h lab.Host) agent.Config {
	cfg := agentconfig.Defaults()
	cfg.Name = h.Name
	cfg.StateDir = StateDir(st.ID, h.Name)
	cfg.JobsDir = JobsDir(st.ID)
	cfg.Socket = Socket(st.ID, h.Name)
	// Not one tree for the lab: a job restored on another host must not land in the cgroup its old host's
	// agent still kills, removes and taps (a self-fenced node's agent removed it under a spare's restore).
	cfg.CgroupParent = CgroupParent(st.ID, h.Name)
	cfg.BPFPinDir = filepath.Join(pinDir(st.ID), h.Name)
	cfg.Cluster.Listen = netip.AddrPortFrom(h.Addr.Addr(), AgentPort)
	tc := c.tls[h.Name]
	cfg.Cluster.CA, cfg.Cluster.Cert, cfg.Cluster.Key = tc.CAFile, tc.CertFile, tc.KeyFile
	late := map[string]bool{}
	for i := len(st.Hosts) - 1; i >= 0 && len(late) < c.opts.LateSpares; i-- {
		if st.Hosts[i].Role == lab.RoleSpare {
			late[st.Hosts[i].Name] = true
		}
	}
	for _, m := range st.Hosts {
		if late[m.Name] && m.Name != h.Name {
			continue
		}
		role := agent.RoleNode
		if m.Role == lab.RoleSpare {
			role = agent.RoleSpare
		}
		cfg.Cluster.Members = append(cfg.Cluster.Members, agent.Member{Name: m.Name, Address: netip.AddrPortFrom(m.Addr.Addr(), AgentPort), Role: role})
	}
	if c.opts.Interval != "" {
		cfg.Checkpoint.Interval.UnmarshalText([]byte(c.opts.Interval))
	}
	if c.opts.Mode != "" {
		cfg.Checkpoint.Mode = c.opts.Mode
	}
	if c.opts.Keep > 0 {
		cfg.Checkpoint.Keep = c.opts.Keep
	}
	if c.opts.LogMemoryMiB > 0 {
		cfg.Log.MemoryMiB = c.opts.LogMemoryMiB
	}
	if c.opts.LogRingMiB > 0 {
		cfg.Log.RingMiB = c.opts.LogRingMiB
	}
	if c.opts.LogNoPark {
		cfg.Log.Park = false
	}
	cfg.Heartbeat.Interval.Duration, cfg.Heartbeat.Timeout.Duration = 200*time.Millisecond, time.Second
	cfg.Heartbeat.Nice = c.opts.Nice
	if c.opts.Heartbeat > 0 {
		cfg.Heartbeat.Interval.Duration = c.opts.Heartbeat
	}
	if c.opts.HeartbeatTimeout > 0 {
		cfg.Heartbeat.Timeout.Duration = c.opts.HeartbeatTimeout
	}
	cfg.Heartbeat.ProbeTimeout.Duration = c.opts.ProbeTimeout
	cfg.Failover.Automatic = !c.opts.ManualFailover
	cfg.Metrics.Listen = c.opts.MetricsListen
	cfg.Failover.FenceCommand = c.opts.FenceCommand
	if c.opts.JobAddresses {
		cfg.JobNetwork.Pool = JobPool(st, h.Name)
		cfg.JobNetwork.Gateway = JobGateway(st)
	}
	if c.opts.FenceTimeout > 0 {
		cfg.Failover.FenceTimeout.Duration = c.opts.FenceTimeout
	}
	if c.opts.ShipEvery > 0 {
		cfg.Log.ReceiveOrderShipEvery.Duration = c.opts.ShipEvery
	}
	if c.opts.NoReceiveOrder {
		cfg.Log.ReceiveOrder = false
	}
	cfg.Log.ReceivePositions = c.opts.ReceivePositions
	cfg.Log.Pessimistic = c.opts.Pessimistic
	if c.opts.ReplayTimeout > 0 {
		cfg.Failover.ReplayTimeout.Duration = c.opts.ReplayTimeout
	}
	if c.opts.KeepEnded > 0 {
		cfg.Checkpoint.KeepEnded.Duration = c.opts.KeepEnded
	}
	if c.opts.AcceptWait > 0 {
		cfg.Checkpoint.AcceptWait.Duration = c.opts.AcceptWait
	}
	if c.opts.ParallelRestores > 0 {
		cfg.Failover.ParallelRestores = c.opts.ParallelRestores
	}
	cfg.Failover.LazyRestore = c.opts.LazyRestore
	// A lab with Slurm admits the starts members forward as a Slurm site does (docs/deploy.md, Slurm): only
	// for a user with a running Slurm job on the target host (lab.startSlurm writes the command).
	if st.Slurm != nil {
		cfg.Cluster.StartJobCommand = slurm.StartJobCommand(st.Slurm.Dir)
	}
	cfg.Health.Command = c.opts.HealthCommand
	if c.opts.HealthInterval > 0 {
		cfg.Health.Interval.Duration, cfg.Health.Timeout.Duration = c.opts.HealthInterval, c.opts.HealthInterval
	}
	return cfg
}

func (c *Cluster) hostDir(host string) string { return filepath.Join(c.runDir, host) }

// ConfigPath is where host's agent configuration is written.
func (c *Cluster) ConfigPath(host string) string { return filepath.Join(c.hostDir(host), "agent.toml") }

// LogPath is host's agent log.
func (c *Cluster) LogPath(host string) string { return filepath.Join(c.hostDir(host), "agent.log") }

// JobCgroup is the cgroup directory of job id on host: its agent's cgroup_parent and the job's id.
func (c *Cluster) JobCgroup(host, id string) string {
	return filepath.Join(CgroupParent(c.Lab.State().ID, host), id)
}

func (c *Cluster) writeConfig(st lab.State, h lab.Host) error {
	cfg := c.config(st, h)
	if err := cfg.Validate(); err != nil {
		return err
	}
	if err := os.MkdirAll(c.hostDir(h.Name), 0o755); err != nil {
		return err
	}
	b, err := toml.Marshal(cfg)
	if err != nil {
		return err
	}
	return os.WriteFile(c.ConfigPath(h.Name), b, 0o644)
}

// StartAgent starts host's agent inside the host's network namespace and waits until it answers.
func (c *Cluster) StartAgent(ctx context.Context, host string) error {
	logf, err := os.OpenFile(c.LogPath(host), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	level := c.opts.LogLevel
	if level == "" {
		level = "info"
	}
	cmd := exec.Command(c.opts.AgentBin, "--config", c.ConfigPath(host), "--log-level", level)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true} // a daemon: not in the caller's process group
	if err := c.Lab.Start(host, cmd); err != nil {
		return fmt.Errorf("start agent on %s: %w", host, err)
	}
	ra := &runningAgent{cmd: cmd, done: make(chan struct{})}
	c.agents[host] = ra
	go func() { cmd.Wait(); close(ra.done) }()
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	cl := c.Client(host)
	for {
		if _, err := cl.Status(ctx); err == nil {
			return nil
		} else if ctx.Err() != nil {
			return fmt.Errorf("agent on %s did not answer within 15s (log: %s): %w", host, c.LogPath(host), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// KillAgent SIGKILLs host's agent (as a crash of the daemon alone would) and waits until it is gone.
func (c *Cluster) KillAgent(host string) error {
	ra, ok := c.agents[host]
	if !ok {
		return fmt.Errorf("no agent of %s was started by this process", host)
	}
	if err := ra.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return err
	}
	<-ra.done
	delete(c.agents, host)
	return nil
}

// SignalAgent sends sig to host's agent: SIGSTOP stands for an agent its host starves, SIGCONT lets it
// run again.
func (c *Cluster) SignalAgent(host string, sig syscall.Signal) error {
	ra, ok := c.agents[host]
	if !ok {
		return fmt.Errorf("no agent of %s was started by this process", host)
	}
	return ra.cmd.Process.Signal(sig)
}

// Revive brings a crashed host back (lab.Lab.Revive: namespace, original address, slurmd) and starts its
// agent again with its old configuration and state directory, as a repaired machine's systemd would.
func (c *Cluster) Revive(ctx context.Context, host string) error {
	if err := c.Lab.Revive(ctx, host); err != nil {
		return err
	}
	// The crash killed the agent; its reaper has closed done or is about to.
	if ra, ok := c.agents[host]; ok {
		<-ra.done
		delete(c.agents, host)
	}
	return c.StartAgent(ctx, host)
}

// Client returns a local-API client for host's agent.
func (c *Cluster) Client(host string) *agentapi.Client {
	return agentapi.NewClient(Socket(c.Lab.State().ID, host))
}

// RemoveJobNets kills whatever runs in any host's job network of job id and removes those networks. Lab
// teardown kills the processes of the hosts' namespaces only, so a test or benchmark that starts jobs with
// job addresses calls this for each, pass or fail.
func RemoveJobNets(id string) error {
	entries, err := os.ReadDir(jobnet.NetnsDir)
	if err != nil {
		return nil // no job network at all
	}
	var errs []error
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "ftj-") || !strings.HasSuffix(e.Name(), "-"+id) {
			continue
		}
		pids, _ := lab.PIDsInNetns(jobnet.Path(e.Name()))
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if err := jobnet.Delete(context.Background(), e.Name(), ""); err != nil {
			errs = append(errs, fmt.Errorf("remove job network %s: %w", e.Name(), err))
		}
	}
	return errors.Join(errs...)
}

// WriteFenceScript writes the lab's stand-in for an IPMI power-off at path, for Options.FenceCommand with
// the arguments {host} {address}: it appends its arguments to record, takes that lab host's link down and
// SIGKILLs every process in its network namespace (what a power cut does to a host; the agents run in their
// host's namespace on the lab's shared mount namespace, so the protector's command reaches /run/netns and
// /proc), and exits 0 only once it has confirmed none is left, as the contract in docs/operations.md asks of
// a real fence command. A host whose namespace is gone (lab.Crash removes it after killing its processes) is off.
func WriteFenceScript(st lab.State, path, record string) error {
	ip, err := exec.LookPath("ip")
	if err != nil {
		return fmt.Errorf("the lab fence script needs iproute2's ip: %w", err)
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		return err
	}
	var cases strings.Builder
	for _, h := range st.Hosts {
		fmt.Fprintf(&cases, "%s) ns=%s ;;\n", h.Name, h.Namespace)
	}
	body := fmt.Sprintf(`#!/bin/sh
echo "$1 $2" >> %[1]s
case "$1" in
%[2]s*) echo "no lab host $1" >&2; exit 2 ;;
esac
if [ ! -e "%[5]s/$ns" ]; then
	echo "lab host $1 is off: its namespace $ns is gone"
	exit 0
fi
# Off the wire first, as a host losing power is at once: the processes killed below then send nothing (no
# FIN, no reset) to peers whose connections a restored copy on a spare will carry on, with this address.
%[3]s -n "$ns" link set dev eth0 down || exit 3
i=0
while [ $i -lt 200 ]; do
	pids=$(%[3]s netns pids "$ns") || exit 3
	if [ -z "$pids" ]; then
		echo "lab host $1 is off: its link down, no process left in namespace $ns"
		exit 0
	fi
	kill -9 $pids 2>/dev/null
	%[4]s 0.05
	i=$((i+1))
done
echo "processes $pids of $1 survive SIGKILL" >&2
exit 1
`, record, cases.String(), ip, sleep, lab.NetnsDir)
	return os.WriteFile(path, []byte(body), 0o700)
}
