package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentconfig"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/fence"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/internal/rootpath"
	"github.com/ftkit/ftkit/internal/sitecmd"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/restore"
)

// minKernel is the oldest kernel with everything the agent attaches: TCX (6.6), BPF ring buffers and
// dynptrs, cgroup_skb programs.
var minKernel = [2]int{6, 6}

// check is one line of --check-config: what was checked, and why it failed (nil: it passed).
type check struct {
	what string
	err  error
}

// warning is a check's finding that is printed but fails nothing: it hurts only some jobs.
type warning struct{ error }

func (c check) warns() bool {
	_, ok := errors.AsType[warning](c.err)
	return ok
}

// resolvConf is where the resolver's configuration is, which jobs on job addresses share with the host.
const resolvConf = "/etc/resolv.conf"

// checkConfig runs every check of --check-config on the configuration at path, writing one line per check
// to w. It creates, loads and binds nothing: it reads files, stats paths and asks CRIU for its version.
// The exit status is 0 when all pass, 2 when the file cannot be read or is invalid (nothing else can be
// checked then), 1 when another check fails. resolv is the resolver's configuration (resolvConf).
func checkConfig(w io.Writer, path, resolv string, now time.Time) error {
	cfg, err := agentconfig.LoadConfig(path)
	if err != nil {
		printChecks(w, []check{{"configuration " + path, err}})
		return cli.WithCode(cli.ExitUsage, errors.New("the configuration is invalid: fix it and check again"))
	}
	checks := []check{{"configuration " + path + " (member " + cfg.Name + ")", nil}}
	var rootErr error
	if os.Geteuid() != 0 {
		rootErr = errors.New("not root: the agent runs as root, and so must this check (CRIU answers root only)")
	}
	checks = append(checks, check{"running as root", rootErr})
	checks = append(checks, credentialChecks(cfg, now)...)
	checks = append(checks, checkListen(cfg))
	checks = append(checks, checkCRIU(cfg.CRIU)...)
	checks = append(checks, check{"nftables in the kernel (a restore's connection guard)", restore.CheckGuards()})
	checks = append(checks, kernelChecks(cfg)...)
	checks = append(checks, dirChecks(cfg)...)
	checks = append(checks, checkFenceCommand(cfg), checkHealthCommand(cfg), checkStartJobCommand(cfg))
	if cfg.JobNetwork.Pool.IsValid() {
		checks = append(checks, check{"job_network.pool " + cfg.JobNetwork.Pool.String() + " on this host's cluster network", cfg.CheckJobNetwork()})
		checks = append(checks, checkJobNameservers(cfg, resolv))
	}
	printChecks(w, checks)
	failed := 0
	for _, c := range checks {
		if c.err != nil && !c.warns() {
			failed++
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d checks failed: fix what the FAIL lines say and check again", failed, len(checks))
	}
	return nil
}

func printChecks(w io.Writer, checks []check) {
	for _, c := range checks {
		if c.err != nil && c.warns() {
			fmt.Fprintf(w, "WARN  %s: %v\n", c.what, c.err)
		} else if c.err != nil {
			fmt.Fprintf(w, "FAIL  %s: %v\n", c.what, c.err)
		} else {
			fmt.Fprintf(w, "ok    %s\n", c.what)
		}
	}
}

// checkJobNameservers warns of nameservers a job network cannot reach (agent.Config.CheckJobNameservers):
// jobs that resolve no names do not mind, so it is a warning.
func checkJobNameservers(cfg agent.Config, resolv string) check {
	what := "nameservers of " + resolv + " reachable from job networks"
	b, err := os.ReadFile(resolv)
	if err != nil {
		return check{what, warning{fmt.Errorf("%w: jobs on job addresses read it like every process of this host", err)}}
	}
	if err := cfg.CheckJobNameservers(b); err != nil {
		return check{what, warning{err}}
	}
	return check{what, nil}
}

// credentialChecks checks the member's certificate, key and CA, and that the key is root's alone.
func credentialChecks(cfg agent.Config, now time.Time) []check {
	c := cfg.Cluster
	// Required without members too: the agent serves the cluster protocol whatever its members, and its
	// listener does not start without them.
	if c.CA == "" || c.Cert == "" || c.Key == "" {
		return []check{{"cluster credentials", errors.New("cluster.ca, cluster.cert and cluster.key are all required (the agent serves the cluster protocol even alone): create them with ftctl pki (docs/deploy.md)")}}
	}
	tc := clustertls.Config{CAFile: c.CA, CertFile: c.Cert, KeyFile: c.Key, CRLFile: c.CRL}
	var out []check
	for _, r := range tc.CheckMember(cfg.Name, now) {
		out = append(out, check{r.What, r.Err})
	}
	out = append(out, check{"key " + c.Key + " is root's alone", privateFile(c.Key)})
	// The CA decides which certificates are members, the CRL which are no longer: a user who can replace
	// either can have a certificate of their own admitted, or a revoked one admitted again.
	out = append(out, check{"CA file " + c.CA + " is root's alone", trustFile(c.CA)})
	if c.CRL != "" {
		out = append(out, check{"CRL file " + c.CRL + " is root's alone", trustFile(c.CRL)})
	}
	return out
}

// trustFile checks that only root can change what path leads to: the file and every directory on the way
// (rootpath), as sitecmd checks a program root runs.
func trustFile(path string) error {
	return rootpath.CheckOnlyRoot(path, "replace whom the cluster trusts", nil)
}

// privateFile checks that path is a regular file (not a link) of root's that nobody else can read.
func privateFile(path string) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	st, _ := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular():
		return fmt.Errorf("is not a regular file (mode %v): put the key itself there", fi.Mode())
	case st != nil && st.Uid != 0:
		return fmt.Errorf("is owned by uid %d: chown root:root it", st.Uid)
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("mode %04o lets others read the member's private key: chmod 600 it (and issue a new key if others did)", fi.Mode().Perm())
	}
	return nil
}

// checkFenceCommand checks that the fence command, which the agent runs as root, is root's alone (the
// agent refuses to run it otherwise, and falls back to the self-fence wait).
func checkFenceCommand(cfg agent.Config) check {
	argv := cfg.Failover.FenceCommand
	if len(argv) == 0 {
		return check{"failover.fence_command: none (a protector waits fence_timeout + margin for a cut-off node to fence itself)", nil}
	}
	return check{"failover.fence_command " + argv[0] + " is root's alone", fence.CheckProgram(argv[0])}
}

// checkHealthCommand checks that the health command, which the agent runs as root, is root's alone (the
// agent refuses to run it otherwise, and nothing predicts a failure).
func checkHealthCommand(cfg agent.Config) check {
	argv := cfg.Health.Command
	if len(argv) == 0 {
		return check{"health.command: none (no failure is predicted: jobs move only when an operator drains a host)", nil}
	}
	return check{"health.command " + argv[0] + " is root's alone", sitecmd.CheckProgram("health command", argv[0])}
}

// checkStartJobCommand checks that the start-job command, which the agent runs as root before it starts a
// job another member forwards, is root's alone (the agent refuses to run it otherwise, and so refuses every
// forwarded start).
func checkStartJobCommand(cfg agent.Config) check {
	argv := cfg.Cluster.StartJobCommand
	if len(argv) == 0 {
		return check{"cluster.start_job_command: none (every job another member forwards starts: any user of a member may run processes on every member)", nil}
	}
	return check{"cluster.start_job_command " + argv[0] + " is root's alone", sitecmd.CheckProgram("start-job command", argv[0])}
}

// checkListen checks that cluster.listen is an address of this host, without binding it.
func checkListen(cfg agent.Config) check {
	l := cfg.Cluster.Listen
	what := "cluster.listen " + l.String() + " is an address of this host"
	if !l.IsValid() {
		return check{"cluster.listen", errors.New("not set: give this host's ip:port in the cluster (its [[cluster.member]] address)")}
	}
	if l.Addr().IsUnspecified() {
		return check{what, nil}
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return check{what, fmt.Errorf("list this host's addresses: %w", err)}
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(net.IP(l.Addr().AsSlice())) {
			return check{what, nil}
		}
	}
	return check{what, errors.New("no interface of this host has that address: fix cluster.listen or the network configuration")}
}

// checkCRIU applies the agent's own CRIU version gate, and says whether the binary carries ftkit's patches
// (the agent runs without them, and warns: so does this check).
func checkCRIU(path string) []check {
	bin, v, err := criu.Require(path)
	if err != nil {
		return []check{{"CRIU " + criu.MinVersion.String() + " or newer", err}}
	}
	patches := check{fmt.Sprintf("CRIU built with ftkit's patches (version %s.%d)", v, criu.PatchLevel()), nil}
	if err := criu.CheckPatches(bin); err != nil {
		patches.err = warning{err}
	}
	return []check{{fmt.Sprintf("CRIU %s or newer (%s is %s)", criu.MinVersion, bin, v), nil}, patches}
}

// kernelChecks checks the kernel version and the file systems the agent uses: BTF for CO-RE eBPF, cgroup
// v2 under cgroup_parent, bpffs (or a directory to mount it on) for its pins.
func kernelChecks(cfg agent.Config) []check {
	rel := version.KernelRelease()
	out := []check{{fmt.Sprintf("kernel %d.%d or newer (TCX, ring buffers, cgroup_skb): %s", minKernel[0], minKernel[1], rel), kernelAtLeast(rel, minKernel)}}
	var btfErr error
	if _, err := os.Stat("/sys/kernel/btf/vmlinux"); err != nil {
		btfErr = fmt.Errorf("%w: the eBPF programs need a kernel built with CONFIG_DEBUG_INFO_BTF=y", err)
	}
	out = append(out, check{"kernel BTF (/sys/kernel/btf/vmlinux)", btfErr})
	out = append(out, check{"cgroup v2 under cgroup_parent " + cfg.CgroupParent, onFS(cfg.CgroupParent, unix.CGROUP2_SUPER_MAGIC,
		"cgroup2", "mount the unified hierarchy (systemd.unified_cgroup_hierarchy=1) or point cgroup_parent into it")})
	pin := cfg.BPFPinDir
	if pin == "" {
		// The agent mounts bpffs on /sys/fs/bpf itself when nothing is mounted there.
		var err error
		if fi, statErr := os.Stat("/sys/fs/bpf"); statErr != nil || !fi.IsDir() {
			err = errors.New("/sys/fs/bpf is missing: the agent mounts bpffs there for its pins; is sysfs mounted?")
		}
		return append(out, check{"bpffs on /sys/fs/bpf (or a directory to mount it on)", err})
	}
	return append(out, check{"bpffs under bpf_pin_dir " + pin, onFS(pin, unix.BPF_FS_MAGIC, "bpf", "mount bpffs there (mount -t bpf bpf /sys/fs/bpf) or change bpf_pin_dir")})
}

// kernelAtLeast compares a release string such as 6.8.0-45-generic with min.
func kernelAtLeast(release string, min [2]int) error {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return fmt.Errorf("cannot read the version of kernel %q", release)
	}
	major, err1 := strconv.Atoi(parts[0])
	minorDigits := parts[1]
	if i := strings.IndexFunc(minorDigits, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		minorDigits = minorDigits[:i] // 6.6-rc1
	}
	minor, err2 := strconv.Atoi(minorDigits)
	if err1 != nil || err2 != nil {
		return fmt.Errorf("cannot read the version of kernel %q", release)
	}
	if major < min[0] || major == min[0] && minor < min[1] {
		return fmt.Errorf("kernel %d.%d is too old: the agent needs %d.%d or newer", major, minor, min[0], min[1])
	}
	return nil
}

// onFS checks that path, or its nearest existing ancestor (the agent creates the rest), lies on a file
// system of the given magic.
func onFS(path string, magic int64, name, fix string) error {
	p := existingAncestor(path)
	var st unix.Statfs_t
	if err := unix.Statfs(p, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", p, err)
	}
	if int64(st.Type) != magic {
		return fmt.Errorf("%s is not on %s (file system type %#x): %s", p, name, st.Type, fix)
	}
	return nil
}

func existingAncestor(path string) string {
	p := filepath.Clean(path)
	for {
		if _, err := os.Lstat(p); err == nil || filepath.Dir(p) == p {
			return p
		}
		p = filepath.Dir(p)
	}
}

// dirChecks checks the directories the agent creates or uses for its state.
func dirChecks(cfg agent.Config) []check {
	type dir struct {
		key, path string
		shared    bool
	}
	dirs := []dir{
		{"state_dir", cfg.StateDir, false},
		{"jobs_dir", cfg.JobsDir, true},
		{"socket directory", filepath.Dir(cfg.Socket), false},
	}
	if cfg.Log.SpillDir != "" {
		dirs = append(dirs, dir{"log.spill_dir", cfg.Log.SpillDir, false})
	}
	var out []check
	for _, d := range dirs {
		out = append(out, check{d.key + " " + d.path + " is safe for root", safeDirPath(d.path, d.shared)})
	}
	return out
}

// safeDirPath checks that no user but root can replace or pre-create dir or anything on its way
// (rootpath.SafeDir, which the agent checks at start too).
func safeDirPath(dir string, shared bool) error { return rootpath.SafeDir(dir, shared) }
