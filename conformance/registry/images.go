package main

// The test images, made from the host's busybox-static: each one an OCI
// index of several platforms (the suite pulls "all platforms" and "some
// platforms"), where linux/amd64 is a real busybox root filesystem and the
// other platforms are a one-file layer (nothing runs them here).

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"time"
)

const (
	mtIndex    = "application/vnd.oci.image.index.v1+json"
	mtManifest = "application/vnd.oci.image.manifest.v1+json"
	mtConfig   = "application/vnd.oci.image.config.v1+json"
	mtLayer    = "application/vnd.oci.image.layer.v1.tar+gzip"
)

// Fixed mtime so that the blobs (and so the digests) are the same every run.
var epoch = time.Unix(1600000000, 0)

// store holds every blob by digest and every tag by "host/repo:tag".
type store struct {
	blobs map[string][]byte
	types map[string]string // media type of manifests and indexes, by digest
	tags  map[string]string // "host/repo:tag" -> digest of its index
}

func newStore() *store {
	return &store{blobs: map[string][]byte{}, types: map[string]string{}, tags: map[string]string{}}
}

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int               `json:"size"`
	Platform    *platform         `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type platform struct {
	Architecture string `json:"architecture"`
	OS           string `json:"os"`
	Variant      string `json:"variant,omitempty"`
}

func (s *store) put(mediaType string, data []byte) descriptor {
	d := fmt.Sprintf("sha256:%x", sha256.Sum256(data))
	s.blobs[d] = data
	if mediaType == mtIndex || mediaType == mtManifest {
		s.types[d] = mediaType
	}
	return descriptor{MediaType: mediaType, Digest: d, Size: len(data)}
}

func (s *store) putJSON(mediaType string, v interface{}) descriptor {
	data, err := json.Marshal(v)
	if err != nil {
		panic(err) // only our own plain structs are encoded
	}
	return s.put(mediaType, data)
}

// entry is one file of a layer.
type entry struct {
	name     string
	mode     int64
	typ      byte
	link     string
	contents []byte
}

// layer is a gzip'd tar of entries and the digest of the plain tar (the diff id).
type layer struct {
	gz     []byte
	diffID string
}

func makeLayer(entries []entry) (layer, error) {
	var plain bytes.Buffer
	tw := tar.NewWriter(&plain)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Mode: e.mode, Typeflag: e.typ, Linkname: e.link,
			ModTime: epoch, Size: int64(len(e.contents)), Format: tar.FormatPAX}
		if err := tw.WriteHeader(h); err != nil {
			return layer{}, err
		}
		if _, err := tw.Write(e.contents); err != nil {
			return layer{}, err
		}
	}
	if err := tw.Close(); err != nil {
		return layer{}, err
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.ModTime = epoch
	if _, err := zw.Write(plain.Bytes()); err != nil {
		return layer{}, err
	}
	if err := zw.Close(); err != nil {
		return layer{}, err
	}
	return layer{gz: gz.Bytes(), diffID: fmt.Sprintf("sha256:%x", sha256.Sum256(plain.Bytes()))}, nil
}

// The users and groups the suite names (www-data is 33, uid 3 has gid 3).
const passwd = `root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
bin:x:2:2:bin:/bin:/bin/false
sys:x:3:3:sys:/dev:/bin/false
sync:x:4:100:sync:/bin:/bin/sync
mail:x:8:8:mail:/var/spool/mail:/bin/false
www-data:x:33:33:www-data:/var/www:/bin/false
operator:x:37:37:Operator:/var:/bin/false
nobody:x:65534:65534:nobody:/home:/bin/false
`

const group = `root:x:0:
daemon:x:1:
bin:x:2:
sys:x:3:
adm:x:4:
tty:x:5:
disk:x:6:
wheel:x:10:root
mail:x:8:
www-data:x:33:
operator:x:37:
users:x:100:
nogroup:x:65533:
nobody:x:65534:
`

// ncWrapper stands in for /bin/nc: busybox nc as PID 1 ignores SIGTERM
// (PID 1 gets no default signal actions), which the real image's nc does
// not; a shell that traps TERM keeps the tests' "kill and wait" working,
// and passes nc's own exit status through otherwise.
const ncWrapper = `#!/bin/sh
busybox nc "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null; exit 143' TERM INT
wait "$child"
`

// busyboxEntries is a busybox root filesystem: the static binary, one
// symlink per applet in /bin, and the usual top-level directories.
func busyboxEntries() ([]entry, []entry, error) {
	bin := ""
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if _, err := os.Stat(p); err == nil {
			bin = p
			break
		}
	}
	if bin == "" {
		return nil, nil, fmt.Errorf("no busybox: apt-get install busybox-static")
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return nil, nil, err
	}
	if bytes.Contains(data[:min(len(data), 4096)], []byte("ld-linux")) {
		return nil, nil, fmt.Errorf("%s is dynamically linked: apt-get install busybox-static", bin)
	}
	out, err := exec.Command(bin, "--list").Output()
	if err != nil {
		return nil, nil, fmt.Errorf("%s --list: %v", bin, err)
	}
	base := []entry{}
	for _, d := range []string{"bin", "dev", "etc", "home", "proc", "root", "sys", "usr", "usr/sbin", "var", "var/www", "run"} {
		base = append(base, entry{name: d + "/", mode: 0o755, typ: tar.TypeDir})
	}
	base = append(base,
		entry{name: "tmp/", mode: 0o1777, typ: tar.TypeDir},
		entry{name: "bin/busybox", mode: 0o755, typ: tar.TypeReg, contents: data},
		entry{name: "etc/passwd", mode: 0o644, typ: tar.TypeReg, contents: []byte(passwd)},
		entry{name: "etc/group", mode: 0o644, typ: tar.TypeReg, contents: []byte(group)},
	)
	applets := []entry{}
	names := strings.Fields(string(out))
	sort.Strings(names)
	for _, a := range names {
		switch a {
		case "busybox":
			continue
		case "nc":
			applets = append(applets, entry{name: "bin/nc", mode: 0o755, typ: tar.TypeReg, contents: []byte(ncWrapper)})
		default:
			applets = append(applets, entry{name: "bin/" + a, mode: 0o777, typ: tar.TypeSymlink, link: "busybox"})
		}
	}
	return base, applets, nil
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}

// imageSpec is one test image: its name, its amd64 layers and its config.
type imageSpec struct {
	ref        string // host/repo:tag
	layers     [][]entry
	entrypoint []string
	cmd        []string
	volumes    []string
}

// add writes the image's blobs and tags it.
func (s *store) add(img imageSpec) error {
	var manifests []descriptor
	for _, p := range []platform{
		{Architecture: "amd64", OS: "linux"},
		{Architecture: "arm64", OS: "linux", Variant: "v8"},
		{Architecture: "arm", OS: "linux", Variant: "v7"},
		{Architecture: "s390x", OS: "linux"},
		{Architecture: "ppc64le", OS: "linux"},
	} {
		layers := img.layers
		if p.Architecture != "amd64" {
			// Another platform: a marker file, enough for fetch and content tests.
			layers = [][]entry{{{name: "platform", mode: 0o644, typ: tar.TypeReg,
				contents: []byte(p.OS + "/" + p.Architecture + "/" + p.Variant + "\n")}}}
		}
		var descs []descriptor
		var diffIDs []string
		for _, l := range layers {
			built, err := makeLayer(l)
			if err != nil {
				return err
			}
			descs = append(descs, s.put(mtLayer, built.gz))
			diffIDs = append(diffIDs, built.diffID)
		}
		volumes := map[string]struct{}{}
		for _, v := range img.volumes {
			volumes[v] = struct{}{}
		}
		config := map[string]interface{}{
			"architecture": p.Architecture,
			"os":           p.OS,
			"created":      epoch.UTC().Format(time.RFC3339),
			"config": map[string]interface{}{
				"Env":        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
				"Entrypoint": img.entrypoint,
				"Cmd":        img.cmd,
				"Volumes":    volumes,
				"WorkingDir": "/",
			},
			"rootfs": map[string]interface{}{"type": "layers", "diff_ids": diffIDs},
		}
		if p.Variant != "" {
			config["variant"] = p.Variant
		}
		cfg := s.putJSON(mtConfig, config)
		m := s.putJSON(mtManifest, map[string]interface{}{
			"schemaVersion": 2,
			"mediaType":     mtManifest,
			"config":        cfg,
			"layers":        descs,
		})
		pl := p
		m.Platform = &pl
		manifests = append(manifests, m)
	}
	idx := s.putJSON(mtIndex, map[string]interface{}{
		"schemaVersion": 2,
		"mediaType":     mtIndex,
		"manifests":     manifests,
	})
	s.tags[img.ref] = idx.Digest
	return nil
}

// buildImages makes every image the suite pulls by name.
func buildImages() (*store, error) {
	base, applets, err := busyboxEntries()
	if err != nil {
		return nil, err
	}
	busybox := append(append([]entry{}, base...), applets...)
	pause := []entry{{name: "pause", mode: 0o755, typ: tar.TypeReg, contents: []byte("#!/bin/sh\nexec sleep 2147483647\n")}}
	s := newStore()
	for _, img := range []imageSpec{
		{ref: "ghcr.io/containerd/busybox:1.32", layers: [][]entry{busybox}, cmd: []string{"sh"}},
		{ref: "ghcr.io/containerd/alpine:3.14.0", layers: [][]entry{busybox}, cmd: []string{"/bin/sh"}},
		{ref: "registry.k8s.io/e2e-test-images/busybox:1.29-2", layers: [][]entry{busybox}, cmd: []string{"sh"}},
		// Several layers and a volume, as its name says.
		{ref: "ghcr.io/containerd/volume-copy-up:2.1", layers: [][]entry{base, applets, {
			{name: "test_dir/", mode: 0o755, typ: tar.TypeDir},
			{name: "test_dir/test_file", mode: 0o644, typ: tar.TypeReg, contents: []byte("test_content\n")},
		}}, cmd: []string{"sh"}, volumes: []string{"/test_dir"}},
		{ref: "k8s.gcr.io/pause:3.6", layers: [][]entry{pause}, entrypoint: []string{"/pause"}},
		{ref: "registry.k8s.io/pause:3.6", layers: [][]entry{pause}, entrypoint: []string{"/pause"}},
	} {
		if err := s.add(img); err != nil {
			return nil, fmt.Errorf("image %s: %v", img.ref, err)
		}
	}
	return s, nil
}
