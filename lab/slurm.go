package lab

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/deploy"
	"github.com/ftkit/ftkit/lab/slurm"
)

// Bounds of the Slurm daemons' life cycle; under load registration takes seconds, so they are generous
// failure timeouts, never waits.
const (
	slurmReadyTimeout = 90 * time.Second
	slurmStopGrace    = 5 * time.Second
)

// SlurmState records the Slurm of a lab so that Down, even after a crashed test or `ftctl`, stops every
// daemon the lab started and removes its state.
type SlurmState struct {
	Dir string `json:"dir"` // slurm.conf, slurmctld's state, the slurmds' spools, pid files, logs
	// Munged is set when this lab started munged (none was running): the lab stops it at Down, unless
	// another lab with Slurm still needs it, which then inherits it.
	Munged *slurm.Proc `json:"munged,omitempty"`
	// Daemons are slurmctld (in the first node) and one slurmd per host; a crashed host's have PID 0.
	Daemons []slurm.Proc `json:"daemons,omitempty"`
}

// SlurmConf is the lab's slurm.conf, or "" when the lab runs no Slurm. Slurm's clients find it in
// SLURM_CONF and must run inside a lab host: slurmctld listens on the first node's lab address.
func (l *Lab) SlurmConf() string {
	if l.st.Slurm == nil {
		return ""
	}
	return slurm.ConfPath(l.st.Slurm.Dir)
}

// update applies fn to the freshly loaded state under the store's lock and saves it.
func (l *Lab) update(fn func(*State)) error {
	return l.store.locked(func() error {
		st, err := l.store.load(l.st.ID)
		if err != nil {
			return err
		}
		fn(&st)
		l.st = st
		return l.store.save(st)
	})
}

// slurmConf renders the lab's slurm.conf: slurmctld in the first node, a slurmd in every host.
func (l *Lab) slurmConf(dir string) (string, error) {
	hostname, err := os.Hostname()
	if err != nil {
		return "", fmt.Errorf("hostname for SlurmctldHost: %w", err)
	}
	c := slurm.Conf{
		ClusterName:    "ftkit-" + l.st.ID,
		ControllerHost: hostname,
		ControllerAddr: l.st.Hosts[0].Addr.Addr(),
		Dir:            dir,
		Partition:      "lab",
		TaskProlog:     slurm.TaskPrologPath(dir),
	}
	for _, h := range l.st.Hosts {
		c.Nodes = append(c.Nodes, slurm.Node{Name: h.Name, Addr: h.Addr.Addr()})
	}
	return slurm.Render(c)
}

// startSlurm starts munged (unless one runs), slurmctld and the slurmds, and waits until every node is
// idle. Each daemon is recorded as soon as it runs, so that Down can stop it whatever fails next.
func (l *Lab) startSlurm(ctx context.Context) error {
	if missing := slurm.Missing(); len(missing) > 0 {
		return fmt.Errorf("lab --slurm: %s not installed; run scripts/setup.sh packages (slurmctld slurmd slurm-client munge)", strings.Join(missing, ", "))
	}
	dir := filepath.Join(l.store.dir, l.st.ID+".slurm")
	// Created before it is recorded, so that Down never removes a directory this lab did not make.
	if err := os.Mkdir(dir, 0o755); err != nil {
		return fmt.Errorf("create the lab's Slurm directory (a leftover of a lab whose state was lost? remove it): %w", err)
	}
	if err := l.update(func(st *State) { st.Slurm = &SlurmState{Dir: dir} }); err != nil {
		return errors.Join(err, os.Remove(dir))
	}
	// Job scripts and slurmctld's state are root's; the configuration and logs are for every user.
	for _, d := range []struct {
		path string
		mode os.FileMode
	}{{slurm.LogDir(dir), 0o755}, {filepath.Join(dir, "run"), 0o755}, {slurm.CtldStateDir(dir), 0o700}, {filepath.Join(dir, "spool"), 0o700}} {
		if err := os.Mkdir(d.path, d.mode); err != nil {
			return fmt.Errorf("create Slurm directory: %w", err)
		}
	}
	conf, err := l.slurmConf(dir)
	if err != nil {
		return err
	}
	if err := os.WriteFile(slurm.ConfPath(dir), []byte(conf), 0o644); err != nil {
		return fmt.Errorf("write slurm.conf: %w", err)
	}
	// A task finds its host's agent through FTKIT_AGENT_SOCKET: in the lab each host's agent listens on its
	// own socket (lab/labcluster's layout: <state dir>/<id>.d/<host>/agent.sock).
	prolog, err := slurm.TaskPrologScript(filepath.Join(DefaultStateDir, l.st.ID+".d", "%n", "agent.sock"))
	if err != nil {
		return err
	}
	if err := os.WriteFile(slurm.TaskPrologPath(dir), []byte(prolog), 0o755); err != nil {
		return fmt.Errorf("write the Slurm task prolog: %w", err)
	}
	// The agents' cluster.start_job_command (lab/labcluster): the script the package ships for Slurm sites,
	// asking this lab's Slurm, so that every start a member forwards in a lab with Slurm goes through it.
	if err := os.WriteFile(slurm.StartJobScriptPath(dir), deploy.SlurmStartJobScript, 0o755); err != nil {
		return fmt.Errorf("write the start-job command: %w", err)
	}
	wrapper, err := slurm.StartJobWrapper(slurm.ConfPath(dir), slurm.StartJobScriptPath(dir))
	if err != nil {
		return err
	}
	if err := os.WriteFile(slurm.StartJobCommandPath(dir), []byte(wrapper), 0o755); err != nil {
		return fmt.Errorf("write the start-job command: %w", err)
	}
	// Under the store's lock, so that two labs coming up together do not both start a munged.
	err = l.store.locked(func() error {
		if _, ok := slurm.RunningMunged(); ok {
			l.log.Debug("reusing the running munged")
			return nil
		}
		p, err := slurm.StartMunged(ctx, filepath.Join(slurm.LogDir(dir), "munged.out"))
		if p.PID != 0 {
			st, lerr := l.store.load(l.st.ID)
			if lerr != nil {
				return errors.Join(err, lerr, slurm.Stop(ctx, p, slurmStopGrace))
			}
			st.Slurm.Munged = &p
			l.st = st
			if serr := l.store.save(st); serr != nil {
				return errors.Join(err, serr, slurm.Stop(ctx, p, slurmStopGrace))
			}
		}
		return err
	})
	if err != nil {
		return err
	}
	if err := l.startSlurmDaemon(l.st.Hosts[0].Name, "slurmctld"); err != nil {
		return err
	}
	var names []string
	for _, h := range l.st.Hosts {
		if err := l.startSlurmDaemon(h.Name, "slurmd"); err != nil {
			return err
		}
		names = append(names, h.Name)
	}
	return l.waitSlurmNodes(ctx, names, func(s string) bool { return s == "idle" })
}

// startSlurmDaemon starts slurmctld or a slurmd in host's namespace, in the foreground of its own
// session so that its recorded pid is the daemon itself, and records it.
func (l *Lab) startSlurmDaemon(host, name string) error {
	dir := l.st.Slurm.Dir
	bin, err := slurm.Binary(name)
	if err != nil {
		return err
	}
	args := []string{"-D", "-f", slurm.ConfPath(dir)}
	if name == "slurmd" {
		args = append(args, "-N", host)
		if err := os.MkdirAll(slurm.SpoolDir(dir, host), 0o700); err != nil {
			return fmt.Errorf("create slurmd spool of %s: %w", host, err)
		}
	}
	out, err := os.OpenFile(filepath.Join(slurm.LogDir(dir), name+"-"+host+".out"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer out.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Env = append(os.Environ(), "SLURM_CONF="+slurm.ConfPath(dir))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var p slurm.Proc
	if err := l.Do(host, func() error {
		var err error
		p, err = slurm.StartDaemon(cmd, name, host)
		return err
	}); err != nil {
		return fmt.Errorf("start %s on %s: %w", name, host, err)
	}
	l.log.Debug("slurm daemon started", "daemon", name, "host", host, "pid", p.PID)
	return l.update(func(st *State) {
		for i, d := range st.Slurm.Daemons {
			if d.Name == name && d.Host == host {
				st.Slurm.Daemons[i] = p
				return
			}
		}
		st.Slurm.Daemons = append(st.Slurm.Daemons, p)
	})
}

// waitSlurmNodes polls sinfo, inside the first node, until every named node's state satisfies ok.
func (l *Lab) waitSlurmNodes(ctx context.Context, nodes []string, ok func(string) bool) error {
	sinfo, err := slurm.Binary("sinfo")
	if err != nil {
		return err
	}
	first := l.st.Hosts[0].Name
	err = slurm.Poll(ctx, slurmReadyTimeout, func() error {
		cmd := exec.Command(sinfo, slurm.SinfoArgs...)
		cmd.Env = append(os.Environ(), "SLURM_CONF="+l.SlurmConf())
		var out []byte
		if err := l.Do(first, func() error {
			var err error
			out, err = cmd.CombinedOutput()
			return err
		}); err != nil {
			return fmt.Errorf("sinfo: %w: %s", err, strings.TrimSpace(string(out)))
		}
		states, err := slurm.ParseSinfo(string(out))
		if err != nil {
			return err
		}
		var bad []string
		for _, n := range nodes {
			if s, found := states[n]; !found || !ok(s) {
				bad = append(bad, n+"="+s)
			}
		}
		if len(bad) > 0 {
			return fmt.Errorf("nodes not ready: %s", strings.Join(bad, " "))
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("lab %s: Slurm did not come up (logs in %s): %w", l.st.ID, slurm.LogDir(l.st.Slurm.Dir), err)
	}
	return nil
}

// stopSlurm stops every Slurm daemon of the lab (the slurmds and slurmctld first, munged last, since
// they talk to it while shutting down) and removes the lab's Slurm directory. Called with the store
// locked, before the hosts are removed.
func (l *Lab) stopSlurm(ctx context.Context) error {
	s := l.st.Slurm
	if s == nil {
		return nil
	}
	// Every step is tried whatever failed before it: a slurmd that survives must not keep munged, which
	// runs outside every host and so outlives the hosts' removal, running.
	var errs []error
	if err := slurm.StopAll(ctx, s.Daemons, slurmStopGrace); err != nil {
		errs = append(errs, err)
	}
	if s.Munged != nil {
		if err := l.handOverMunged(ctx, *s.Munged); err != nil {
			errs = append(errs, err)
		} else {
			s.Munged = nil
		}
	}
	if len(errs) > 0 {
		// The daemons stay recorded for the next Down; munged no longer, if it is stopped or handed over.
		return errors.Join(append(errs, l.store.save(l.st))...)
	}
	if err := removeTree(s.Dir); err != nil {
		return err
	}
	l.st.Slurm = nil
	return l.store.save(l.st)
}

// handOverMunged gives munged to another lab with Slurm, which still needs it, or stops it. Called with
// the store locked.
func (l *Lab) handOverMunged(ctx context.Context, p slurm.Proc) error {
	labs, err := l.store.all()
	if err != nil {
		return err
	}
	for _, other := range labs {
		if other.ID == l.st.ID || other.Slurm == nil || other.Slurm.Munged != nil {
			continue
		}
		other.Slurm.Munged = &p
		l.log.Debug("munged handed over", "to", other.ID)
		return l.store.save(other)
	}
	return slurm.Stop(ctx, p, slurmStopGrace)
}

// slurmHostGone forgets the daemons of a crashed host (the crash killed them) and its slurmd's spool, as
// a power cut would. Called with the store locked.
func (l *Lab) slurmHostGone(host string) error {
	s := l.st.Slurm
	if s == nil {
		return nil
	}
	for i, d := range s.Daemons {
		if d.Host == host {
			s.Daemons[i].PID, s.Daemons[i].Start = 0, 0
		}
	}
	return removeTree(slurm.SpoolDir(s.Dir, host))
}

// reviveSlurm restarts a revived host's daemons (slurmctld too, if it ran there) and waits until its
// node answers slurmctld again.
func (l *Lab) reviveSlurm(ctx context.Context, host string) error {
	if l.st.Slurm == nil {
		return nil
	}
	nodes := []string{host}
	for _, d := range l.st.Slurm.Daemons {
		if d.Host == host && !d.Alive() {
			if err := l.startSlurmDaemon(host, d.Name); err != nil {
				return err
			}
			if d.Name == "slurmctld" {
				// A restarted controller knows its nodes again only once each slurmd has re-registered.
				nodes = nil
				for _, h := range l.st.Hosts {
					if !h.Crashed {
						nodes = append(nodes, h.Name)
					}
				}
			}
		}
	}
	// "*" marks a node slurmctld cannot reach; down, drained or unknown nodes take no jobs.
	return l.waitSlurmNodes(ctx, nodes, func(s string) bool {
		return !strings.HasSuffix(s, "*") && !strings.HasPrefix(s, "down") && !strings.HasPrefix(s, "drain") && !strings.HasPrefix(s, "unk")
	})
}
