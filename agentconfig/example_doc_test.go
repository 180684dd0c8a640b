package agentconfig

import (
	"bufio"
	"encoding"
	"os"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// configKeys lists every key the configuration file accepts ("section.key", "cluster.member.name"),
// from the toml tags of Config.
func configKeys(t reflect.Type, prefix string, out map[string]bool) {
	text := reflect.TypeOf((*encoding.TextUnmarshaler)(nil)).Elem()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := strings.Split(f.Tag.Get("toml"), ",")[0]
		if tag == "" || tag == "-" {
			continue
		}
		key := prefix + tag
		ft := f.Type
		if ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct {
			ft = ft.Elem()
		}
		if ft.Kind() == reflect.Struct && !reflect.PointerTo(ft).Implements(text) {
			configKeys(ft, key+".", out)
			continue
		}
		out[key] = true
	}
}

var (
	exampleTable = regexp.MustCompile(`^\[\[?([a-z_.]+)\]\]?\s*$`)
	// A key set (`key = ...`) or shown commented out (`# key = ...`).
	exampleKey = regexp.MustCompile(`^(# )?([a-z_]+) = `)
)

// exampleKeys lists the keys docs/agent.example.toml sets or shows commented out, and which of them it sets.
func exampleKeys(t *testing.T) (all, set map[string]bool) {
	f, err := os.Open("../docs/agent.example.toml")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	all, set = map[string]bool{}, map[string]bool{}
	table := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		if m := exampleTable.FindStringSubmatch(l); m != nil {
			table = m[1] + "."
			continue
		}
		if m := exampleKey.FindStringSubmatch(l); m != nil {
			all[table+m[2]] = true
			if m[1] == "" {
				set[table+m[2]] = true
			}
		}
	}
	return all, set
}

// Every key the agent accepts is documented in docs/agent.example.toml, and every key there exists.
func TestExampleDocumentsEveryKey(t *testing.T) {
	code := map[string]bool{}
	configKeys(reflect.TypeOf(Config{}), "", code)
	doc, _ := exampleKeys(t)
	var undocumented, unknown []string
	for k := range code {
		if !doc[k] {
			undocumented = append(undocumented, k)
		}
	}
	for k := range doc {
		if !code[k] {
			unknown = append(unknown, k)
		}
	}
	sort.Strings(undocumented)
	sort.Strings(unknown)
	if len(undocumented) > 0 {
		t.Errorf("keys the agent accepts that docs/agent.example.toml does not show: %v", undocumented)
	}
	if len(unknown) > 0 {
		t.Errorf("keys docs/agent.example.toml shows that the agent does not accept: %v", unknown)
	}
}

// The values docs/agent.example.toml sets are the defaults ("Every key below shows its default"): apart
// from this host's identity and cluster, the parsed example is Defaults(). A key without a fixed default
// (one derived from others, like failover.fence_timeout) is shown commented out, so that a copy of the
// example still derives it.
func TestExampleShowsDefaults(t *testing.T) {
	c, err := LoadConfig("../docs/agent.example.toml")
	if err != nil {
		t.Fatal(err)
	}
	d := Defaults()
	c.Name, c.Cluster = d.Name, d.Cluster
	cv, dv := reflect.ValueOf(c), reflect.ValueOf(d)
	var diff func(prefix string, a, b reflect.Value)
	diff = func(prefix string, a, b reflect.Value) {
		for i := 0; i < a.NumField(); i++ {
			f := a.Type().Field(i)
			key := prefix + strings.Split(f.Tag.Get("toml"), ",")[0]
			if f.Type.Kind() == reflect.Struct && f.Type.PkgPath() == "" {
				diff(key+".", a.Field(i), b.Field(i))
				continue
			}
			if f.Type.Kind() == reflect.Struct && (f.Type == reflect.TypeOf(HealthConfig{}) || f.Type == reflect.TypeOf(LogConfig{}) || f.Type == reflect.TypeOf(JobNetworkConfig{})) {
				diff(key+".", a.Field(i), b.Field(i))
				continue
			}
			if !reflect.DeepEqual(a.Field(i).Interface(), b.Field(i).Interface()) {
				t.Errorf("docs/agent.example.toml sets %s = %v; the default is %v", key, a.Field(i).Interface(), b.Field(i).Interface())
			}
		}
	}
	diff("", cv, dv)
	// The commented-out keys that show a derived default show the one the example's other values derive.
	if got := c.ProbeTimeout(); got.String() != "3s" {
		t.Errorf("heartbeat.probe_timeout is shown as 3s; the example's derives %s", got)
	}
	if got := c.FenceTiming().Timeout; got.String() != "7s" {
		t.Errorf("failover.fence_timeout is shown as 7s; the example's derives %s", got)
	}
}

// A key docs/agent.example.toml shows commented out shows its default, unless it has none (an optional
// file or command, shown as an example) or derives it from other keys (checked above): uncommenting it
// changes nothing.
func TestExampleCommentedKeysShowDefaults(t *testing.T) {
	noDefault := map[string]bool{
		"cluster.crl":               true, // optional
		"cluster.start_job_command": true, // optional
		"failover.fence_command":    true, // optional
		"health.command":            true, // optional
		"bpf_pin_dir":               true, // derived from name (agent pinDir)
		"heartbeat.probe_timeout":   true, // derived from heartbeat.timeout
		"failover.fence_timeout":    true, // derived from the heartbeat timing
	}
	src, err := os.ReadFile("../docs/agent.example.toml")
	if err != nil {
		t.Fatal(err)
	}
	base, err := ParseConfig(src)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(src), "\n")
	table := ""
	for i, l := range lines {
		if m := exampleTable.FindStringSubmatch(l); m != nil {
			table = m[1] + "."
			continue
		}
		m := exampleKey.FindStringSubmatch(l)
		if m == nil || m[1] == "" || noDefault[table+m[2]] {
			continue
		}
		edited := append([]string{}, lines...)
		edited[i] = strings.TrimPrefix(l, "# ")
		c, err := ParseConfig([]byte(strings.Join(edited, "\n")))
		if err != nil {
			t.Errorf("line %d, %q uncommented: %v", i+1, edited[i], err)
			continue
		}
		if !reflect.DeepEqual(c, base) {
			t.Errorf("line %d shows %q as the default, but setting it changes the configuration (the default differs)", i+1, edited[i])
		}
	}
}
