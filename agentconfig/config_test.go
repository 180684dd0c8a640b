package agentconfig

import (
	"os"
	"strings"
	"testing"
	"time"
)

func TestExampleConfigParses(t *testing.T) {
	c, err := LoadConfig("../docs/agent.example.toml")
	if err != nil {
		t.Fatalf("the documented example must stay valid: %v", err)
	}
	if c.Name != "node1" || len(c.Cluster.Members) != 4 || c.Cluster.Members[3].Role != RoleSpare {
		t.Fatalf("parsed %+v", c)
	}
	if c.Checkpoint.Interval.Fixed != 60*time.Second || c.Heartbeat.Timeout.Duration != 3*time.Second {
		t.Fatalf("durations: %+v %+v", c.Checkpoint, c.Heartbeat)
	}
	if got := c.Cluster.Listen.String(); got != "10.201.0.11:7420" {
		t.Fatalf("listen %s", got)
	}
	// fence_timeout defaults to 2 × heartbeat.timeout + 1s.
	if ft := c.FenceTiming(); ft.Timeout != 7*time.Second || ft.Interval != 500*time.Millisecond {
		t.Fatalf("fence timing %+v: want 7s from the 3s heartbeat timeout", ft)
	}
	// The metrics endpoint is off unless asked for.
	if c.Metrics.Listen != "" || Defaults().Metrics.Listen != "" {
		t.Fatalf("metrics.listen %q, default %q: want the endpoint off by default", c.Metrics.Listen, Defaults().Metrics.Listen)
	}
}

const minimal = `
name = "a"
[[cluster.member]]
name = "a"
address = "10.0.0.1:1"
role = "node"
[[cluster.member]]
name = "b"
address = "10.0.0.2:1"
role = "node"
`

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name    string
		extra   string
		replace [2]string
		wantErr string
	}{
		{name: "minimal is valid"},
		{name: "auto interval", extra: "[checkpoint]\ninterval = \"auto\"\n"},
		{name: "unknown key", extra: "colour = \"red\"\n", wantErr: "colour"},
		{name: "criu absolute", extra: "criu = \"/opt/criu/sbin/criu\"\n"},
		{name: "criu relative", extra: "criu = \"criu\"\n", wantErr: `criu "criu": give the binary by absolute path`},
		{name: "bad interval", extra: "[checkpoint]\ninterval = \"often\"\n", wantErr: "use a duration like 60s, or auto"},
		{name: "short interval", extra: "[checkpoint]\ninterval = \"10ms\"\n", wantErr: "at least 1s"},
		{name: "min_interval zero", extra: "[checkpoint]\nmin_interval = \"0s\"\n", wantErr: "checkpoint.min_interval 0s: must be positive"},
		{name: "min_interval negative", extra: "[checkpoint]\nmin_interval = \"-1s\"\n", wantErr: "checkpoint.min_interval -1s: must be positive"},
		{name: "interval below min_interval", extra: "[checkpoint]\nmin_interval = \"5m\"\n", wantErr: "checkpoint.interval 1m0s is below checkpoint.min_interval: use at least 5m0s"},
		{name: "raised min_interval", extra: "[checkpoint]\nmin_interval = \"30s\"\ninterval = \"30s\"\n"},
		{name: "bad mode", extra: "[checkpoint]\nmode = \"global\"\n", wantErr: "checkpoint.mode"},
		{name: "keep zero", extra: "[checkpoint]\nkeep = 0\n", wantErr: "keep at least 1"},
		{name: "parallel restores zero", extra: "[failover]\nparallel_restores = 0\n", wantErr: "parallel_restores 0: 1 (one job after another) to 16"},
		{name: "parallel restores too many", extra: "[failover]\nparallel_restores = 17\n", wantErr: "parallel_restores 17"},
		{name: "ship every", extra: "[log]\nreceive_order_ship_every = \"20ms\"\n"},
		{name: "ship every at once", extra: "[log]\nreceive_order_ship_every = \"0s\"\n"},
		{name: "ship every negative", extra: "[log]\nreceive_order_ship_every = \"-1ms\"\n", wantErr: "log.receive_order_ship_every -1ms: must be between 0 (at once) and 1s"},
		{name: "ship every too long", extra: "[log]\nreceive_order_ship_every = \"2s\"\n", wantErr: "log.receive_order_ship_every 2s"},
		{name: "max flows", extra: "[log]\nmax_flows = 262144\n"},
		{name: "max flows too few", extra: "[log]\nmax_flows = 100\n", wantErr: "log.max_flows 100: use 1024..4194304"},
		{name: "max flows too many", extra: "[log]\nmax_flows = 4194305\n", wantErr: "log.max_flows 4194305"},
		{name: "heartbeat", extra: "[heartbeat]\ninterval = \"2s\"\ntimeout = \"1s\"\n", wantErr: "heartbeat"},
		{name: "probe timeout and nice", extra: "[heartbeat]\nprobe_timeout = \"150ms\"\nnice = -10\n"},
		{name: "probe timeout negative", extra: "[heartbeat]\nprobe_timeout = \"-1s\"\n", wantErr: "heartbeat.probe_timeout -1s must not be negative"},
		{name: "nice positive: the jobs first", extra: "[heartbeat]\nnice = 19\n"},
		{name: "accept_wait zero", extra: "[checkpoint]\naccept_wait = \"0s\"\n", wantErr: "checkpoint.accept_wait 0s must be positive and at most 30s"},
		{name: "accept_wait over half a hold", extra: "[checkpoint]\naccept_wait = \"31s\"\n", wantErr: "checkpoint.accept_wait 31s"},
		{name: "dump_timeout below CRIU's freeze bound", extra: "[checkpoint]\ndump_timeout = \"5s\"\n", wantErr: "checkpoint.dump_timeout 5s must be between 10s and 10m0s"},
		{name: "dump_timeout past a coordinated step", extra: "[checkpoint]\ndump_timeout = \"11m\"\n", wantErr: "checkpoint.dump_timeout 11m0s"},
		{name: "nice too high", extra: "[heartbeat]\nnice = 20\n", wantErr: "heartbeat.nice 20 must be between -20 and 19"},
		{name: "nice too low", extra: "[heartbeat]\nnice = -21\n", wantErr: "heartbeat.nice -21"},
		{name: "fence timeout", extra: "[failover]\nfence_timeout = \"10s\"\n"},
		{name: "fence timeout below twice the heartbeat timeout", extra: "[failover]\nfence_timeout = \"5s\"\n", wantErr: "fence_timeout 5s is shorter than twice heartbeat.timeout (3s)"},
		{name: "fence timeout negative", extra: "[failover]\nfence_timeout = \"-1s\"\n", wantErr: "must not be negative"},
		{name: "fence command", extra: "[failover]\nfence_command = [\"/usr/local/sbin/fence-ipmi\", \"{host}\", \"{address}\"]\n"},
		{name: "fence command relative", extra: "[failover]\nfence_command = [\"fence-ipmi\", \"{host}\"]\n", wantErr: "absolute path"},
		{name: "fence command placeholder", extra: "[failover]\nfence_command = [\"/bin/fence\", \"{node}\"]\n", wantErr: "{host} and {address}"},
		{name: "fence command timeout", extra: "[failover]\nfence_command_timeout = \"0s\"\n", wantErr: "fence_command_timeout 0s must be positive"},
		{name: "not a member", replace: [2]string{`name = "a"` + "\n[[", `name = "z"` + "\n[["}, wantErr: `name "z" is not a cluster.member`},
		{name: "bad address", replace: [2]string{"10.0.0.2:1", "10.0.0.2"}, wantErr: "line 9"},
		{name: "duplicate address", replace: [2]string{"10.0.0.2:1", "10.0.0.1:1"}, wantErr: "used twice"},
		{name: "bad role", replace: [2]string{`role = "node"` + "\n[[", `role = "boss"` + "\n[["}, wantErr: `role "boss"`},
		{name: "metrics on loopback", extra: "[metrics]\nlisten = \"127.0.0.1:9464\"\n"},
		{name: "metrics on ipv6 loopback", extra: "[metrics]\nlisten = \"[::1]:9464\"\n"},
		{name: "metrics without a port", extra: "[metrics]\nlisten = \"127.0.0.1\"\n", wantErr: `metrics.listen "127.0.0.1": use ip:port, like 127.0.0.1:9464`},
		{name: "metrics on a host name", extra: "[metrics]\nlisten = \"localhost:9464\"\n", wantErr: `metrics.listen "localhost:9464": use ip:port`},
		{name: "metrics on port 0", extra: "[metrics]\nlisten = \"127.0.0.1:0\"\n", wantErr: `metrics.listen "127.0.0.1:0": use a fixed port`},
		{name: "metrics unknown key", extra: "[metrics]\naddress = \"127.0.0.1:9464\"\n", wantErr: "12| address"},
		{name: "one node", replace: [2]string{`name = "b"` + "\naddress = \"10.0.0.2:1\"\nrole = \"node\"", `name = "b"` + "\naddress = \"10.0.0.2:1\"\nrole = \"spare\""}, wantErr: "at least 2 members with role node"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src := minimal
			if tt.replace[0] != "" {
				if !strings.Contains(src, tt.replace[0]) {
					t.Fatalf("test bug: %q not in the config", tt.replace[0])
				}
				src = strings.Replace(src, tt.replace[0], tt.replace[1], 1)
			}
			// Top-level keys must come before the first table; tables may follow the members.
			if strings.HasPrefix(tt.extra, "[") {
				src += tt.extra
			} else {
				src = tt.extra + src
			}
			_, err := ParseConfig([]byte(src))
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want it to mention %q", err, tt.wantErr)
			}
		})
	}
}

// A job's interval is checked against checkpoint.min_interval: any local user can start a job, and the
// agent dumps as root.
func TestCheckJobInterval(t *testing.T) {
	c := Defaults()
	raised := Defaults()
	raised.Checkpoint.MinInterval = Duration{time.Minute}
	tests := []struct {
		cfg     Config
		iv      string
		wantErr string
	}{
		{c, "", ""},
		{c, "auto", ""},
		{c, "1s", ""},
		{c, "90s", ""},
		{c, "1ms", "interval 1ms is below this agent's minimum of 1s (checkpoint.min_interval)"},
		{c, "999ms", "below this agent's minimum of 1s"},
		{c, "0s", "use a positive duration"},
		{c, "0", "use a positive duration"},
		{c, "-10s", "use a positive duration"},
		{c, "often", "use a duration like 60s, or auto"},
		{raised, "30s", "below this agent's minimum of 1m0s"},
		{raised, "1m", ""},
		{raised, "auto", ""},
	}
	for _, tt := range tests {
		err := tt.cfg.CheckJobInterval(tt.iv)
		if tt.wantErr == "" && err != nil {
			t.Errorf("min %s, interval %q: %v", tt.cfg.Checkpoint.MinInterval, tt.iv, err)
		}
		if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("min %s, interval %q: err = %v, want it to mention %q", tt.cfg.Checkpoint.MinInterval, tt.iv, err, tt.wantErr)
		}
	}
}

func TestExampleConfigDocumentsMinInterval(t *testing.T) {
	b, err := os.ReadFile("../docs/agent.example.toml")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "\nmin_interval = \"1s\"\n") || Defaults().Checkpoint.MinInterval.Duration != time.Second {
		t.Fatal("docs/agent.example.toml must show checkpoint.min_interval with its default, 1s")
	}
}

func TestLoadConfigMissingFile(t *testing.T) {
	_, err := LoadConfig(t.TempDir() + "/nope.toml")
	if err == nil || !os.IsNotExist(errorsUnwrapAll(err)) {
		t.Fatalf("err = %v", err)
	}
}

func errorsUnwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}

// The agent's directories and socket are opened relative to its working directory when relative: / under
// systemd, wherever root stood when started by hand, and whatever directory ftagent --check-config ran in
// when checked. A restored process reopens its output by the path under jobs_dir, the same on every host, and
// cgroup_parent must be absolute for the receive-order probe: a relative path must be refused, not resolved.
func TestRelativeDirsRefused(t *testing.T) {
	for _, tt := range []struct{ extra, wantErr string }{
		{"state_dir = \"/srv/ftkit\"\njobs_dir = \"/srv/ftkit/jobs\"\nsocket = \"/run/ftkit/a.sock\"\n", ""},
		{"state_dir = \"var/lib/ftkit\"\n", `state_dir "var/lib/ftkit": give an absolute path`},
		{"jobs_dir = \"jobs\"\n", `jobs_dir "jobs": give an absolute path`},
		{"socket = \"agent.sock\"\n", `socket "agent.sock": give an absolute path`},
		{"cgroup_parent = \"ftkit\"\n", `cgroup_parent "ftkit": give an absolute path`},
		{"bpf_pin_dir = \"ftkit/node1\"\n", `bpf_pin_dir "ftkit/node1": give an absolute path`},
		{"[log]\nspill_dir = \"spill\"\n", `log.spill_dir "spill": give an absolute path`},
		{"[log]\nspill_dir = \"/var/spool/ftkit\"\n", ""},
	} {
		src := minimal + tt.extra
		if !strings.HasPrefix(tt.extra, "[") {
			src = tt.extra + minimal
		}
		_, err := ParseConfig([]byte(src))
		if tt.wantErr == "" && err != nil {
			t.Errorf("%q: %v", tt.extra, err)
		}
		if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%q: err = %v, want it to mention %q", tt.extra, err, tt.wantErr)
		}
	}
}

// The agent builds its first membership view from cluster.member (agent loadView: ring.New), which refuses
// members the view could not hold: a configuration that passes Validate (and so --check-config) must not
// stop the agent at its start with "membership view ...: remove it to start again from the configuration".
func TestMembersTheViewRefuses(t *testing.T) {
	for _, tt := range []struct{ name, from, to, wantErr string }{
		{"upper-case name", `name = "b"`, `name = "B"`, `may only contain a-z, 0-9`},
		{"underscore in a name", `name = "b"`, `name = "node_b"`, `may only contain a-z, 0-9`},
		{"name an IP address", `name = "b"`, `name = "10.0.0.9"`, `is an IP address`},
		{"port 0", "10.0.0.2:1", "10.0.0.2:0", `cluster address "10.0.0.2:0" must be ip:port`},
		{"unspecified address", "10.0.0.2:1", "0.0.0.0:1", `host address "0.0.0.0" is not a usable IP address`},
		{"two members on one host", "10.0.0.2:1", "10.0.0.1:2", `host address 10.0.0.1 is held by both "a" and "b"`},
		{"the same address, IPv4-mapped", "10.0.0.2:1", "[::ffff:10.0.0.1]:1", `held by both "a" and "b"`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if !strings.Contains(minimal, tt.from) {
				t.Fatalf("test bug: %q not in the config", tt.from)
			}
			_, err := ParseConfig([]byte(strings.Replace(minimal, tt.from, tt.to, 1)))
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want it to mention %q", err, tt.wantErr)
			}
		})
	}
}

// jobs_dir is the cluster's, the same path on every host and, where ftwrap follows moved jobs, one shared
// file system: a state_dir in it (or the same directory) would be shared by every host configured alike, each
// agent reading and overwriting the others' job records, grants, claims and views, and a users' directory
// besides. jobs_dir inside state_dir is the default layout.
func TestStateDirInsideJobsDirRefused(t *testing.T) {
	for _, tt := range []struct{ extra, wantErr string }{
		{"state_dir = \"/var/lib/ftkit\"\njobs_dir = \"/var/lib/ftkit/jobs\"\n", ""},
		{"state_dir = \"/var/lib/ftkit\"\njobs_dir = \"/shared/ftkit/jobs\"\n", ""},
		{"state_dir = \"/shared/ftkit-state\"\njobs_dir = \"/shared/ftkit\"\n", ""},
		{"state_dir = \"/shared/ftkit/jobs\"\njobs_dir = \"/shared/ftkit/jobs\"\n", `state_dir "/shared/ftkit/jobs" is jobs_dir or lies inside it`},
		{"state_dir = \"/shared/ftkit/jobs/state\"\njobs_dir = \"/shared/ftkit/jobs\"\n", `state_dir "/shared/ftkit/jobs/state" is jobs_dir or lies inside it`},
		{"state_dir = \"/shared/ftkit/jobs/\"\njobs_dir = \"/shared/ftkit/jobs\"\n", `is jobs_dir or lies inside it`},
	} {
		_, err := ParseConfig([]byte(tt.extra + minimal))
		if tt.wantErr == "" && err != nil {
			t.Errorf("%q: %v", tt.extra, err)
		}
		if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%q: err = %v, want it to mention %q", tt.extra, err, tt.wantErr)
		}
	}
}
