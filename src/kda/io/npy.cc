#include "kda/io/npy.h"

#include <zip.h>
#include <zlib.h>

#include <bit>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string_view>

#include "kda/common/bf16.h"
#include "kda/io/file.h"

namespace kda::io {

// Element bytes are copied as-is; the format is little-endian, so the host must be too.
static_assert(std::endian::native == std::endian::little, "kda::io assumes a little-endian host");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

[[noreturn]] void fail(const std::string& what, const std::string& problem) {
  throw std::runtime_error(what + ": " + problem);
}

struct DescrEntry {
  const char* descr;
  NpyDType dtype;
};
constexpr DescrEntry kDescrs[] = {
    {"<f4", NpyDType::F32}, {"<f8", NpyDType::F64}, {"<f2", NpyDType::F16},  {"<i4", NpyDType::I32},
    {"<i8", NpyDType::I64}, {"|u1", NpyDType::U8},  {"|b1", NpyDType::Bool},
};

const char* descr_of(NpyDType t) {
  for (const auto& e : kDescrs)
    if (e.dtype == t) return e.descr;
  throw std::invalid_argument("npy: bad dtype enum value");
}

// Product of a shape's extents; throws when an extent is negative or the product overflows.
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) fail(what, "negative dimension in shape");
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) fail(what, "shape's element count overflows");
    n *= d;
  }
  return n;
}

// A minimal reader for the Python dict literal numpy writes as the .npy header, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (64, 256), }
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  void parse(std::string& descr, bool& fortran, std::vector<int64_t>& shape) {
    bool have_descr = false, have_fortran = false, have_shape = false;
    expect('{');
    while (true) {
      skip_ws();
      if (peek() == '}') {
        ++pos_;
        break;
      }
      const std::string key = parse_string();
      expect(':');
      skip_ws();
      if (key == "descr") {
        // A list here means a structured dtype, which this reader does not support.
        if (peek() != '\'' && peek() != '"') bad("unsupported descr (structured dtypes are not supported)");
        descr = parse_string();
        have_descr = true;
      } else if (key == "fortran_order") {
        fortran = parse_bool();
        have_fortran = true;
      } else if (key == "shape") {
        shape = parse_tuple();
        have_shape = true;
      } else {
        bad("unexpected key '" + key + "' in header");
      }
      skip_ws();
      if (peek() == ',') {
        ++pos_;
      } else if (peek() != '}') {
        bad("expected ',' or '}' in header");
      }
    }
    if (!have_descr) bad("header lacks 'descr'");
    if (!have_fortran) bad("header lacks 'fortran_order'");
    if (!have_shape) bad("header lacks 'shape'");
  }

 private:
  [[noreturn]] void bad(const std::string& problem) const {
    fail(what_, "malformed .npy header: " + problem);
  }

  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  void expect(char c) {
    skip_ws();
    if (peek() != c) bad(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::string parse_string() {
    skip_ws();
    const char q = peek();
    if (q != '\'' && q != '"') bad("expected a quoted string");
    const size_t end = s_.find(q, pos_ + 1);
    if (end == std::string_view::npos) bad("unterminated string");
    std::string out(s_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return out;
  }
  bool parse_bool() {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    bad("fortran_order is neither True nor False");
  }
  std::vector<int64_t> parse_tuple() {
    std::vector<int64_t> dims;
    expect('(');
    while (true) {
      skip_ws();
      if (peek() == ')') {
        ++pos_;
        return dims;
      }
      if (!std::isdigit(static_cast<unsigned char>(peek())))
        bad("shape holds something other than an integer");
      int64_t v = 0;
      while (std::isdigit(static_cast<unsigned char>(peek()))) {
        const int digit = peek() - '0';
        if (v > (std::numeric_limits<int64_t>::max() - digit) / 10) bad("shape extent too large");
        v = v * 10 + digit;
        ++pos_;
      }
      if (peek() == 'L') ++pos_;  // Python 2 longs
      dims.push_back(v);
      skip_ws();
      if (peek() == ',') {
        ++pos_;
      } else if (peek() != ')') {
        bad("expected ',' or ')' in shape");
      }
    }
  }

  std::string_view s_;
  const std::string& what_;
  size_t pos_ = 0;
};

NpyDType dtype_from_descr(const std::string& descr, const std::string& what) {
  for (const auto& e : kDescrs)
    if (descr == e.descr) return e.dtype;
  if (!descr.empty() && descr[0] == '>') fail(what, "big-endian descr '" + descr + "' is not supported");
  fail(what, "unknown descr '" + descr + "' (supported: <f4 <f8 <f2 <i4 <i8 |u1 |b1)");
}

std::string shape_tuple(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

template <typename T>
T load_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

struct ZipCloser {
  void operator()(zip_t* z) const { zip_discard(z); }
};
using ZipPtr = std::unique_ptr<zip_t, ZipCloser>;
struct ZipSourceFree {
  void operator()(zip_source_t* s) const { zip_source_free(s); }
};
using ZipSourcePtr = std::unique_ptr<zip_source_t, ZipSourceFree>;

// The most a deflate stream can expand (zlib's limit is about 1032:1): a member declaring more is corrupt,
// and refusing it up front keeps a forged size from allocating gigabytes.
constexpr uint64_t kMaxDeflateRatio = 1032;

std::string zip_open_error(int code) {
  zip_error_t err;
  zip_error_init_with_code(&err, code);
  std::string msg = zip_error_strerror(&err);
  zip_error_fini(&err);
  return msg;
}

}  // namespace

const char* to_string(NpyDType t) {
  switch (t) {
    case NpyDType::F32:
      return "float32";
    case NpyDType::F64:
      return "float64";
    case NpyDType::F16:
      return "float16";
    case NpyDType::I32:
      return "int32";
    case NpyDType::I64:
      return "int64";
    case NpyDType::U8:
      return "uint8";
    case NpyDType::Bool:
      return "bool";
  }
  return "?";
}

size_t dtype_size(NpyDType t) {
  switch (t) {
    case NpyDType::F32:
    case NpyDType::I32:
      return 4;
    case NpyDType::F64:
    case NpyDType::I64:
      return 8;
    case NpyDType::F16:
      return 2;
    case NpyDType::U8:
    case NpyDType::Bool:
      return 1;
  }
  return 0;
}

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> NpyArray::to_f32() const {
  const size_t n = static_cast<size_t>(numel());
  if (bytes.size() != n * dtype_size(dtype))
    throw std::invalid_argument("NpyArray: byte size does not match shape");
  std::vector<float> out(n);
  const uint8_t* p = bytes.data();
  switch (dtype) {
    case NpyDType::F32:
      if (n) std::memcpy(out.data(), p, n * sizeof(float));
      break;
    case NpyDType::F64:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(load_le<double>(p + 8 * i));
      break;
    case NpyDType::F16:
      for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(load_le<uint16_t>(p + 2 * i));
      break;
    case NpyDType::I32:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(load_le<int32_t>(p + 4 * i));
      break;
    case NpyDType::I64:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(load_le<int64_t>(p + 8 * i));
      break;
    case NpyDType::U8:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
      break;
    case NpyDType::Bool:
      for (size_t i = 0; i < n; ++i) out[i] = p[i] ? 1.0f : 0.0f;
      break;
  }
  return out;
}

std::vector<int32_t> NpyArray::to_i32() const {
  const size_t n = static_cast<size_t>(numel());
  if (bytes.size() != n * dtype_size(dtype))
    throw std::invalid_argument("NpyArray: byte size does not match shape");
  std::vector<int32_t> out(n);
  const uint8_t* p = bytes.data();
  switch (dtype) {
    case NpyDType::I32:
      if (n) std::memcpy(out.data(), p, n * sizeof(int32_t));
      break;
    case NpyDType::I64:
      for (size_t i = 0; i < n; ++i) {
        const int64_t v = load_le<int64_t>(p + 8 * i);
        if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
          throw std::out_of_range("NpyArray::to_i32: int64 value " + std::to_string(v) + " at index " +
                                  std::to_string(i) + " is out of int32 range");
        out[i] = static_cast<int32_t>(v);
      }
      break;
    case NpyDType::U8:
      for (size_t i = 0; i < n; ++i) out[i] = p[i];
      break;
    case NpyDType::Bool:
      for (size_t i = 0; i < n; ++i) out[i] = p[i] ? 1 : 0;
      break;
    default:
      throw std::invalid_argument(std::string("NpyArray::to_i32: cannot convert ") + to_string(dtype) +
                                  " to int32");
  }
  return out;
}

NpyArray NpyArray::from_f32(std::vector<int64_t> shape, const float* data) {
  NpyArray a;
  a.dtype = NpyDType::F32;
  const int64_t n = checked_numel(shape, "NpyArray::from_f32");
  a.shape = std::move(shape);
  a.bytes.resize(static_cast<size_t>(n) * sizeof(float));
  if (n) std::memcpy(a.bytes.data(), data, a.bytes.size());
  return a;
}

NpyArray NpyArray::from_i32(std::vector<int64_t> shape, const int32_t* data) {
  NpyArray a;
  a.dtype = NpyDType::I32;
  const int64_t n = checked_numel(shape, "NpyArray::from_i32");
  a.shape = std::move(shape);
  a.bytes.resize(static_cast<size_t>(n) * sizeof(int32_t));
  if (n) std::memcpy(a.bytes.data(), data, a.bytes.size());
  return a;
}

NpyArray parse_npy(const uint8_t* data, size_t size, const std::string& what) {
  if (size < kMagicLen + 2 || std::memcmp(data, kMagic, kMagicLen) != 0)
    fail(what, "bad magic: not a .npy file");
  const uint8_t major = data[6];
  size_t header_len = 0, prefix = 0;
  if (major == 1) {
    prefix = 10;
    if (size < prefix) fail(what, "truncated .npy preamble");
    header_len = load_le<uint16_t>(data + 8);
  } else if (major == 2 || major == 3) {  // 3.0 differs from 2.0 only in the header's text encoding
    prefix = 12;
    if (size < prefix) fail(what, "truncated .npy preamble");
    header_len = load_le<uint32_t>(data + 8);
  } else {
    fail(what, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(data[7]));
  }
  if (header_len > size - prefix) fail(what, "truncated .npy header");

  std::string descr;
  bool fortran = false;
  NpyArray a;
  HeaderParser(std::string_view(reinterpret_cast<const char*>(data + prefix), header_len), what)
      .parse(descr, fortran, a.shape);
  a.dtype = dtype_from_descr(descr, what);
  if (fortran) fail(what, "fortran_order True is not supported (C order only)");

  const int64_t n = checked_numel(a.shape, what);
  const size_t offset = prefix + header_len;
  const size_t avail = size - offset;
  const size_t esize = dtype_size(a.dtype);
  if (static_cast<uint64_t>(n) > avail / esize || static_cast<size_t>(n) * esize != avail) {
    const std::string expected = std::to_string(static_cast<uint64_t>(n)) + " x " + std::to_string(esize);
    if (static_cast<uint64_t>(n) > avail / esize)
      fail(what, "truncated data: shape " + shape_tuple(a.shape) + " needs " + expected + " bytes but only " +
                     std::to_string(avail) + " remain");
    fail(what, "data size mismatch: shape " + shape_tuple(a.shape) + " needs " + expected + " bytes but " +
                   std::to_string(avail) + " follow the header");
  }
  a.bytes.assign(data + offset, data + size);
  return a;
}

std::vector<uint8_t> serialize_npy(const NpyArray& a) {
  const int64_t n = checked_numel(a.shape, "serialize_npy");
  if (a.bytes.size() != static_cast<size_t>(n) * dtype_size(a.dtype))
    throw std::invalid_argument("serialize_npy: byte size does not match shape and dtype");

  std::string header = std::string("{'descr': '") + descr_of(a.dtype) +
                       "', 'fortran_order': False, 'shape': " + shape_tuple(a.shape) + ", }";
  // numpy pads the header with spaces and a final '\n' so the data starts on a 64-byte boundary.
  auto padded = [&](size_t prefix) {
    const size_t unpadded = prefix + header.size() + 1;
    return header + std::string((64 - unpadded % 64) % 64, ' ') + "\n";
  };
  std::string h = padded(10);
  const bool v1 = h.size() <= std::numeric_limits<uint16_t>::max();
  if (!v1) h = padded(12);

  // Sized once and filled with memcpy (GCC 12 misreports vector::insert of a small array here).
  const size_t prefix = v1 ? 10 : 12;
  std::vector<uint8_t> out(prefix + h.size() + a.bytes.size());
  std::memcpy(out.data(), kMagic, kMagicLen);
  out[kMagicLen] = v1 ? 1 : 2;
  out[kMagicLen + 1] = 0;
  const uint32_t len = static_cast<uint32_t>(h.size());
  for (size_t i = 0; i < prefix - kMagicLen - 2; ++i)
    out[kMagicLen + 2 + i] = static_cast<uint8_t>(len >> (8 * i));
  std::memcpy(out.data() + prefix, h.data(), h.size());
  if (!a.bytes.empty()) std::memcpy(out.data() + prefix + h.size(), a.bytes.data(), a.bytes.size());
  return out;
}

NpyArray read_npy(const std::filesystem::path& path) {
  const std::vector<uint8_t> buf = read_regular_file(path, ".npy file");
  return parse_npy(buf.data(), buf.size(), path.string());
}

void write_npy(const std::filesystem::path& path, const NpyArray& a) {
  const std::vector<uint8_t> buf = serialize_npy(a);
  write_file_atomic(path, buf.data(), buf.size());
}

NpzArchive parse_npz(const uint8_t* data, size_t size, const std::string& what) {
  // libzip opens a zero-length source as a new, empty archive; NumPy refuses an empty file.
  if (size == 0) fail(what, "empty file: not an .npz archive");
  zip_error_t zerr;
  zip_error_init(&zerr);
  ZipSourcePtr src(zip_source_buffer_create(data, size, 0, &zerr));
  if (!src) {
    const std::string msg = zip_error_strerror(&zerr);
    zip_error_fini(&zerr);
    fail(what, "cannot read as .npz: " + msg);
  }
  // ZIP_CHECKCONS: each member's local header must agree with the central directory. When they do not,
  // the archive is read without the check, so that the member at fault is named (its sizes or CRC-32
  // below); only when every member reads back intact is the inconsistency itself the error.
  ZipPtr za(zip_open_from_source(src.get(), ZIP_RDONLY | ZIP_CHECKCONS, &zerr));
  bool inconsistent = false;
  if (!za && zip_error_code_zip(&zerr) == ZIP_ER_INCONS) {
    inconsistent = true;
    zip_error_fini(&zerr);
    zip_error_init(&zerr);
    za.reset(zip_open_from_source(src.get(), ZIP_RDONLY, &zerr));
  }
  if (!za) {
    const std::string msg = zip_error_strerror(&zerr);
    zip_error_fini(&zerr);
    fail(what, "cannot open as .npz: " + msg);
  }
  zip_error_fini(&zerr);
  src.release();  // the archive owns the source now

  NpzArchive out;
  const zip_int64_t count = zip_get_num_entries(za.get(), 0);
  for (zip_int64_t i = 0; i < count; ++i) {
    zip_stat_t st;
    zip_stat_init(&st);
    if (zip_stat_index(za.get(), static_cast<zip_uint64_t>(i), 0, &st) != 0)
      fail(what, "cannot stat member " + std::to_string(i) + ": " + zip_strerror(za.get()));
    constexpr zip_uint64_t kNeeded =
        ZIP_STAT_NAME | ZIP_STAT_SIZE | ZIP_STAT_COMP_SIZE | ZIP_STAT_COMP_METHOD | ZIP_STAT_CRC;
    if ((st.valid & kNeeded) != kNeeded)
      fail(what, "member " + std::to_string(i) + " lacks a name, sizes, compression method or CRC-32");
    const std::string name = st.name;
    if (!name.empty() && name.back() == '/') continue;  // a directory entry
    const std::string member = what + ":" + name;
    constexpr std::string_view kSuffix = ".npy";
    if (name.size() < kSuffix.size() ||
        name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0)
      fail(member, "member is not a .npy file");
    const std::string key = name.substr(0, name.size() - kSuffix.size());
    if (out.count(key)) fail(member, "duplicate member");

    // The declared sizes, checked before anything is allocated from them.
    if (st.comp_size > size)
      fail(member, "compressed size " + std::to_string(st.comp_size) + " is larger than the archive (" +
                       std::to_string(size) + " bytes)");
    if (st.comp_method == ZIP_CM_STORE) {
      if (st.size != st.comp_size)
        fail(member, "stored member's size " + std::to_string(st.size) +
                         " differs from its compressed size " + std::to_string(st.comp_size));
    } else if (st.comp_method == ZIP_CM_DEFLATE) {
      if (st.size / kMaxDeflateRatio > st.comp_size)
        fail(member, "size " + std::to_string(st.size) + " is more than deflate can expand " +
                         std::to_string(st.comp_size) + " compressed bytes to");
    } else {
      fail(member, "compression method " + std::to_string(st.comp_method) +
                       " is not supported (stored or deflated, as NumPy writes)");
    }

    zip_file_t* zf = zip_fopen_index(za.get(), static_cast<zip_uint64_t>(i), 0);
    if (!zf) fail(member, std::string("cannot open member: ") + zip_strerror(za.get()));
    std::vector<uint8_t> buf(static_cast<size_t>(st.size));
    const auto read_into = [&](uint8_t* dst, zip_uint64_t n) {
      zip_uint64_t got = 0;
      while (got < n) {
        const zip_int64_t r = zip_fread(zf, dst + got, n - got);
        if (r < 0) {
          const std::string msg = zip_error_strerror(zip_file_get_error(zf));
          zip_fclose(zf);
          fail(member, "read failed: " + msg);
        }
        if (r == 0) break;
        got += static_cast<zip_uint64_t>(r);
      }
      return got;
    };
    const zip_uint64_t got = read_into(buf.data(), st.size);
    if (got < st.size) {
      zip_fclose(zf);
      fail(member, "truncated: " + std::to_string(got) + " of its " + std::to_string(st.size) + " bytes");
    }
    // Checked here, as NumPy does: libzip checks the CRC only when a read reaches the end of the data.
    const uLong crc = crc32_z(crc32_z(0L, Z_NULL, 0), buf.data(), buf.size());
    if (crc != st.crc) {
      zip_fclose(zf);
      char msg[96];
      std::snprintf(msg, sizeof msg, "Bad CRC-32: the data's is %08lx, the archive records %08x",
                    static_cast<unsigned long>(crc), static_cast<unsigned>(st.crc));
      fail(member, msg);
    }
    // Nothing may follow the declared size (a deflate stream that inflates to more is corrupt).
    uint8_t extra = 0;
    if (read_into(&extra, 1) != 0) {
      zip_fclose(zf);
      fail(member, "holds more data than its declared size " + std::to_string(st.size));
    }
    const int close_err = zip_fclose(zf);
    if (close_err != 0) fail(member, zip_open_error(close_err));
    out.emplace(key, parse_npy(buf.data(), buf.size(), member));
  }
  if (inconsistent) fail(what, "cannot open as .npz: local and central headers of a member disagree");
  return out;
}

NpzArchive read_npz(const std::filesystem::path& path) {
  const std::vector<uint8_t> buf = read_regular_file(path, ".npz file");
  return parse_npz(buf.data(), buf.size(), path.string());
}

std::vector<uint8_t> serialize_npz(const NpzArchive& arrays) {
  if (arrays.empty()) {
    // libzip writes nothing for an empty archive; np.savez() writes a bare end-of-central-directory record.
    std::vector<uint8_t> eocd(22, 0);
    const uint8_t sig[4] = {0x50, 0x4b, 0x05, 0x06};
    std::memcpy(eocd.data(), sig, sizeof sig);
    return eocd;
  }
  const auto fail_zip = [](const std::string& problem, zip_error_t* e) {
    const std::string msg = zip_error_strerror(e);
    zip_error_fini(e);
    throw std::runtime_error("serialize_npz: " + problem + ": " + msg);
  };
  zip_error_t zerr;
  zip_error_init(&zerr);
  ZipSourcePtr src(zip_source_buffer_create(nullptr, 0, 0, &zerr));
  if (!src) fail_zip("cannot create a buffer", &zerr);
  ZipPtr za(zip_open_from_source(src.get(), ZIP_TRUNCATE, &zerr));
  if (!za) fail_zip("cannot create an archive", &zerr);
  zip_error_fini(&zerr);
  // The archive holds one reference and frees it on close; ours keeps the written bytes readable.
  zip_source_keep(src.get());

  // libzip reads the sources only in zip_close, so the images must outlive it.
  std::vector<std::vector<uint8_t>> images;
  images.reserve(arrays.size());
  for (const auto& [key, array] : arrays) {
    images.push_back(serialize_npy(array));
    const std::string name = key + ".npy";
    zip_source_t* member = zip_source_buffer(za.get(), images.back().data(), images.back().size(), 0);
    if (!member)
      throw std::runtime_error("serialize_npz: cannot add member " + name + ": " + zip_strerror(za.get()));
    const zip_int64_t idx = zip_file_add(za.get(), name.c_str(), member, ZIP_FL_ENC_UTF_8);
    if (idx < 0) {
      zip_source_free(member);
      throw std::runtime_error("serialize_npz: cannot add member " + name + ": " + zip_strerror(za.get()));
    }
    // Stored, as np.savez writes.
    if (zip_set_file_compression(za.get(), static_cast<zip_uint64_t>(idx), ZIP_CM_STORE, 0) != 0)
      throw std::runtime_error("serialize_npz: cannot set compression of " + name + ": " +
                               zip_strerror(za.get()));
  }
  if (zip_close(za.get()) != 0)
    throw std::runtime_error(std::string("serialize_npz: cannot write the archive: ") +
                             zip_strerror(za.get()));
  za.release();  // zip_close freed it

  zip_stat_t st;
  zip_stat_init(&st);
  if (zip_source_stat(src.get(), &st) != 0 || !(st.valid & ZIP_STAT_SIZE) || zip_source_open(src.get()) != 0)
    throw std::runtime_error("serialize_npz: cannot read the written archive back");
  std::vector<uint8_t> out(static_cast<size_t>(st.size));
  const zip_int64_t got = zip_source_read(src.get(), out.data(), out.size());
  zip_source_close(src.get());
  if (got < 0 || static_cast<zip_uint64_t>(got) != st.size)
    throw std::runtime_error("serialize_npz: cannot read the written archive back");
  return out;
}

void write_npz(const std::filesystem::path& path, const NpzArchive& arrays) {
  const std::vector<uint8_t> bytes = serialize_npz(arrays);
  write_file_atomic(path, bytes.data(), bytes.size());
}

}  // namespace kda::io
